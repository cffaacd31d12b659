// The sync point. Reads as its phases: collect the live pending storages,
// build the graph, look up or build a plan, execute, bind the results back
// to the storages, then report the first error if an op raised.
#include "capture/capture.h"
#include "engine/engine.h"
#include "engine/execution.h"
#include "ir/call_state.h"
#include "runtime/calibrate.h"
#include "runtime/lanes.h"
#include "runtime/sanitizer.h"
#include "stats.h"

#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <new>
#include <thread>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace torch_mgpu {

Counters& counters() {
  static Counters c;
  return c;
}

namespace engine {
namespace {

std::shared_ptr<const PlanRecord>& last_plan_slot() {
  static auto* p = new std::shared_ptr<const PlanRecord>();
  return *p;
}

std::vector<capture::LazyBuffer*> collect() {
  auto bufs = capture::pending_buffers();
  // Creation order, so that the same program builds the same graph (and
  // hash) every time, whatever the registry's iteration order.
  std::sort(bufs.begin(), bufs.end(), [](auto* a, auto* b) {
    if (a->value.node->id != b->value.node->id) return a->value.node->id < b->value.node->id;
    return a->value.index < b->value.index;
  });
  return bufs;
}

// The bytes a version of a storage holds.
size_t value_nbytes(const ir::Value& v) {
  const auto& n = *v.node;
  if (n.kind == ir::NodeKind::Data) return n.data.nbytes();
  return v.index < static_cast<int>(n.outputs.size()) ? n.outputs[v.index].nbytes : 0;
}

// Why node i of `g` did not produce its outputs: its own error, or that of
// the failed node it waited for.
std::string lost_because(int i, const ir::Graph& g, const runtime::ExecResult& res) {
  std::vector<int> todo{i};
  std::vector<char> seen(g.size(), 0);
  while (!todo.empty()) {
    const int k = todo.back();
    todo.pop_back();
    if (seen[k]) continue;
    seen[k] = 1;
    auto m = res.messages.find(k);
    if (m != res.messages.end()) return m->second;
    for (int d : g.deps[k])
      if (res.status[d] != runtime::Status::Ok) todo.push_back(d);
  }
  return res.first_message.empty() ? std::string("an earlier op failed") : res.first_message;
}

// The value a storage ends with when the node making it did not run: an
// in-place write that failed leaves the storage as it was before the op
// (when that earlier version survives and covers the storage); anything
// else becomes an error naming the op that failed.
ir::Value resolve(ir::Value v, const ir::Graph& g, const runtime::ExecResult& res) {
  while (true) {
    const int i = g.find(v.node.get());
    if (i < 0) return v;  // materialized before this sync
    if (res.status[i] == runtime::Status::Ok) {
      auto s = res.values[i][v.index];
      TORCH_INTERNAL_ASSERT(static_cast<bool>(s), "mgpu: a result was freed before binding");
      return ir::Value{ir::make_data(std::move(s)), 0};
    }
    // An in-place write that did not happen leaves the storage with its
    // previous version: its own bytes when the node wrote a copy, the same
    // bytes when it was to write in place (a node fails before it writes,
    // or, as in eager, part-way). Either way the write happened once or
    // not at all, and the storage stays readable. A write that was to grow
    // the storage (out= into a smaller tensor) leaves nothing readable at
    // the tensor's new size: its value is lost.
    const auto& out = v.node->outputs[v.index];
    if (out.mutated_operand >= 0 && value_nbytes(v.node->operands[out.mutated_operand]) >= out.nbytes) {
      v = v.node->operands[out.mutated_operand];
      continue;
    }
    return ir::Value{ir::make_error("mgpu: this tensor's value was lost when an op failed: " + lost_because(i, g, res),
                                    out.nbytes),
                     0};
  }
}

std::shared_ptr<PlanRecord> describe(const ir::Graph& g, const plan::Plan& p, const runtime::ExecResult* r) {
  auto rec = std::make_shared<PlanRecord>();
  rec->graph = ir::summarize(g);
  for (const auto& l : p.lanes) rec->lane_names.push_back(l.name);
  rec->lane_of = p.lane_of;
  if (r) {
    rec->timing = r->timing;
    rec->measured_makespan = r->makespan;
  }
  rec->fused = p.fusion.group_of;
  rec->predicted_start = p.predicted_start;
  rec->predicted_end = p.predicted_end;
  rec->policy = p.policy;
  rec->lanes_used = p.lanes_used;
  rec->transfers = p.transfers;
  rec->predicted_makespan = p.predicted_makespan;
  rec->refined = p.refined;
  rec->graph_hash = g.hash;
  return rec;
}

int host_cores() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    std::string item = s.substr(start, end - start);
    item.erase(0, item.find_first_not_of(" "));
    item.erase(item.find_last_not_of(" ") + 1);
    if (!item.empty()) out.push_back(item);
    start = end + 1;
  }
  return out;
}

// The devices a topology string names, checked against what this machine has.
void check_devices(const plan::Topology& t) {
  if (!t.cuda) return;
  const int visible = runtime::cuda_device_count();
  TORCH_CHECK(visible > 0, "torch_mgpu: CUDA lanes need a CUDA device, and none is available ",
              "(a CPU build of torch, or no GPU); use cpu devices");
  for (const auto& d : t.devices) {
    auto dev = runtime::physical_device(d);
    TORCH_CHECK(dev.index() < visible, "torch_mgpu: device '", d, "' does not exist (", visible,
                " CUDA device(s) visible)");
  }
}

// Where CUDA is available, every visible device with a few streams each
// (TORCH_MGPU_LANES overrides); else one CPU lane per core.
constexpr int kStreamsPerDevice = 4;

// A cached plan, and what its first runs measured: after the first run
// (cold: first touches of memory) kRefineRuns runs record each node's
// measured / predicted time; then the graph is planned again, once, with
// each node's median ratio as its Work::scale, if any node was off by more
// than kRefineOff. Later runs keep that plan (no flip-flop under noise).
struct CachedPlan {
  std::shared_ptr<const plan::Plan> plan;
  const Lanes* lanes = nullptr;  // what it was planned for (the cache is emptied when they change)
  std::vector<std::vector<double>> ratios;  // per node, one per measured run
  int runs = 0;
  bool settled = false;
};
constexpr int kRefineRuns = 3;
constexpr double kRefineOff = 1.5;
// Nodes shorter than this, measured and predicted, keep scale 1: their times
// are mostly the clock and the call.
constexpr double kRefineMinSeconds = 50e-6;

bool refine_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("TORCH_MGPU_REFINE");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

struct Config;
Config& config();

// Lanes (and their places), the policy and the plan cache.
// Locking: `m` guards the pointer `lanes` and `plans`; a Lanes never
// changes once made (configure() swaps in a new one), so an execution reads
// the one it started with, with no lock. Only configure() writes `lanes`,
// under the state lock and with no flight running.
struct Config {
  std::mutex m;
  std::shared_ptr<const Lanes> lanes;
  std::unordered_map<uint64_t, CachedPlan> plans;  // by graph hash
  Config() {
    const char* d = std::getenv("TORCH_MGPU_DEVICES");
    const char* l = std::getenv("TORCH_MGPU_LANES");
    const char* p = std::getenv("TORCH_MGPU_POLICY");
    std::vector<std::string> devices;
    if (d) {
      devices = split(d);
    } else {
      for (int k = 0; k < runtime::cuda_device_count(); ++k) devices.push_back("cuda:" + std::to_string(k));
      if (devices.empty()) devices.push_back("cpu");
    }
    lanes = make_lanes(checked_topology(devices, l ? std::atoi(l) : default_lanes(devices)), p ? p : "auto");
    // A fork() while the background worker plans under `m` would leave it
    // held in the child, whose first sync needs it: fork waits for it.
    pthread_atfork([] { config().m.lock(); }, [] { config().m.unlock(); }, [] { config().m.unlock(); });
  }
  static int default_lanes(const std::vector<std::string>& devices) {
    if (!devices.empty() && devices[0].rfind("cuda", 0) == 0) return kStreamsPerDevice;
    return std::max(1, host_cores() / static_cast<int>(devices.size()));
  }
  // A topology for `devices`, refused (with a clear error) if this machine lacks them.
  static plan::Topology checked_topology(const std::vector<std::string>& devices, int lanes) {
    auto t = plan::make_topology(devices, lanes, host_cores());
    check_devices(t);
    return t;
  }
  static std::shared_ptr<const Lanes> make_lanes(plan::Topology t, std::string policy) {
    auto l = std::make_shared<Lanes>();
    l->places = runtime::make_places(t);
    l->topo = std::move(t);
    l->policy = std::move(policy);
    return l;
  }
};

Config& config() {
  static auto* c = new Config();
  return *c;
}

// Plans that run on CPU lanes fuse runs of elementwise ops (plan/fusion.h);
// stream lanes (CUDA, or CPU under the stream sanitizer) run every node alone.
bool fused_lanes(const Lanes& l) {
  return plan::fusion_enabled() && !l.topo.cuda && (l.places.empty() || !l.places[0].streams);
}

std::shared_ptr<const plan::Plan> plan_for(const ir::Graph& g, const Lanes& l) {
  if (runtime::in_forked_child())  // no lane threads here: one lane, the calling thread
    return std::make_shared<const plan::Plan>(plan::make_serial_plan(g, l.topo, cost_model(), fused_lanes(l)));
  const auto& cm = cost_model();  // before the config lock: it reads the lanes
  auto& c = config();
  std::lock_guard<std::mutex> lock(c.m);
  auto it = c.plans.find(g.hash);
  if (it != c.plans.end() && it->second.lanes == &l) {
    counters().plan_cache_hits++;
    return it->second.plan;
  }
  auto p = std::make_shared<const plan::Plan>(plan::make_plan(g, l.topo, cm, l.policy, fused_lanes(l)));
  counters().plans_built++;
  if (c.plans.size() >= 1024) c.plans.clear();  // bounded
  CachedPlan& e = c.plans[g.hash];
  e = CachedPlan();
  e.plan = p;
  e.lanes = &l;
  return p;
}

// Records what a run of cached plan `p` measured (see CachedPlan), and plans
// the graph again with the measured scales when the runs are in.
void learn(const ir::Graph& g, const Lanes& l, const std::shared_ptr<const plan::Plan>& p,
           const runtime::ExecResult& r) {
  if (!refine_enabled() || r.first_error || r.timing.size() != g.size()) return;
  const auto& cm = cost_model();  // before the config lock: it reads the lanes
  auto& c = config();
  std::lock_guard<std::mutex> lock(c.m);
  auto it = c.plans.find(g.hash);
  if (it == c.plans.end() || it->second.plan != p || it->second.settled) return;
  CachedPlan& e = it->second;
  const size_t n = g.size();
  if (e.runs++ == 0) return;  // the cold run
  e.ratios.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const bool fused = !p->fusion.group_of.empty() && p->fusion.group_of[i] >= 0;  // a group's time, shared out
    const double measured = r.timing[i].end - r.timing[i].start;
    const double predicted = p->predicted_end[i] - p->predicted_start[i];
    if (fused || predicted <= 0 || std::max(measured, predicted) < kRefineMinSeconds) continue;
    e.ratios[i].push_back(measured / predicted);
  }
  if (e.runs <= kRefineRuns) return;
  e.settled = true;
  std::vector<double> scale(n, 1.0);
  bool off = false;
  for (size_t i = 0; i < n; ++i) {
    auto& v = e.ratios[i];
    if (v.size() < static_cast<size_t>(kRefineRuns)) continue;  // not measured in every run
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    scale[i] = std::max(v[v.size() / 2], 1e-3);  // a node the model knows nothing of can be off by 100x and more
    off = off || scale[i] > kRefineOff || scale[i] < 1.0 / kRefineOff;
  }
  e.ratios.clear();
  if (!off) return;  // the model was right: keep the plan
  e.plan = std::make_shared<const plan::Plan>(plan::make_plan(g, l.topo, cm, l.policy, fused_lanes(l), scale));
  counters().plans_built++;
}

} // namespace

std::shared_ptr<const Lanes> current_lanes() {
  auto& c = config();
  std::lock_guard<std::mutex> lock(c.m);
  return c.lanes;
}

std::shared_ptr<const PlanRecord> last_plan() {
  capture::StateLock lock;
  return last_plan_slot();
}

namespace {
// A cost model measured once per process. Not a function-local static: fork()
// while another thread measures (a background flight's first plan, say) would
// leave the static's guard taken forever in the child. Here a child whose
// parent was mid-measurement takes the default model: measuring again would
// run parallel ATen ops, and PyTorch's OpenMP pool does not survive fork().
class MeasuredOnce {
public:
  template <typename Measure>
  const plan::CostModel& get(Measure&& measure) {
    std::unique_lock<std::mutex> lock(m_);
    cv_.wait(lock, [&] { return state_ != State::Measuring; });
    if (state_ == State::Done) return model_;
    state_ = State::Measuring;
    lock.unlock();
    plan::CostModel measured;
    try {
      measured = measure();
    } catch (...) {
      lock.lock();
      state_ = State::None;
      cv_.notify_all();
      throw;
    }
    lock.lock();
    model_ = measured;
    state_ = State::Done;
    cv_.notify_all();
    return model_;
  }

  void after_fork_in_child() {
    new (&m_) std::mutex();  // the parent's may have been held by a thread the child lacks
    new (&cv_) std::condition_variable();
    if (state_ == State::Measuring) {
      model_ = plan::CostModel();
      state_ = State::Done;
    }
  }

private:
  enum class State { None, Measuring, Done };
  std::mutex m_;
  std::condition_variable cv_;
  State state_ = State::None;
  plan::CostModel model_;
};

MeasuredOnce& cpu_model() {
  static auto* once = new MeasuredOnce();  // leaked: background threads may outlive static teardown
  return *once;
}
MeasuredOnce& device_model() {
  static auto* once = new MeasuredOnce();
  return *once;
}
const bool g_models_atfork = [] {
  cpu_model();
  device_model();
  pthread_atfork(nullptr, nullptr, [] {
    cpu_model().after_fork_in_child();
    device_model().after_fork_in_child();
  });
  return true;
}();
} // namespace

const plan::CostModel& cost_model() {
  static const bool skip = std::getenv("TORCH_MGPU_NO_CALIBRATION") != nullptr;
  auto lanes = current_lanes();
  if (lanes->topo.cuda) {
    // Devices of one topology are taken to be alike: the first one is measured.
    const auto device = lanes->places.at(0).device;
    return device_model().get([&] { return skip ? plan::CostModel() : runtime::calibrate_device(device); });
  }
  return cpu_model().get([&] { return skip ? plan::CostModel() : runtime::calibrate_cpu(host_cores()); });
}

void configure(const std::vector<std::string>& devices, int lanes_per_device, const std::string& policy) {
  TORCH_CHECK(lanes_per_device >= 0, "torch_mgpu.configure: lanes_per_device must be >= 1, got ", lanes_per_device,
              " (0 keeps the current value)");
  capture::StateLock lock;
  if (!policy.empty()) {
    TORCH_CHECK(policy == "auto" || policy == "heft" || policy == "serial", "torch_mgpu: unknown policy '", policy,
                "' (expected 'serial', 'heft' or 'auto')");
  }
  auto now = current_lanes();
  std::vector<std::string> devs = devices.empty() ? now->topo.devices : devices;
  int lanes = lanes_per_device > 0 ? lanes_per_device : now->topo.lanes_per_device;
  if (!devices.empty() && lanes_per_device <= 0) lanes = Config::default_lanes(devs);
  auto topo = Config::checked_topology(devs, lanes);  // refused before anything runs
  capture::sync_all();  // pending work runs where it was planned to (and no flight runs on)
  auto next = Config::make_lanes(std::move(topo), policy.empty() ? now->policy : policy);
  auto& c = config();
  std::lock_guard<std::mutex> config_lock(c.m);
  c.lanes = std::move(next);
  c.plans.clear();
}

void start_stream_sanitizer() {
  capture::StateLock lock;
  TORCH_CHECK(!current_lanes()->topo.cuda,
              "torch_mgpu: the stream sanitizer checks CPU lanes run as stream lanes; configure CPU devices first "
              "(torch_mgpu.configure(devices=['cpu', 'cpu']))");
  capture::sync_all();  // what is pending runs on the host lanes it was planned for
  runtime::start_stream_sanitizer();
  try {
    configure({}, 0, "");
  } catch (...) {
    runtime::stop_stream_sanitizer();
    configure({}, 0, "");
    throw;
  }
}

std::vector<std::string> stop_stream_sanitizer() {
  capture::StateLock lock;  // held throughout: nothing runs between the stop and the new lanes
  std::exception_ptr failed;
  try {
    capture::sync_all();
  } catch (...) {
    failed = std::current_exception();  // stopped all the same; raised after
  }
  auto races = runtime::stop_stream_sanitizer();
  configure({}, 0, "");
  if (failed) std::rethrow_exception(failed);
  return races;
}

std::vector<std::string> lane_names() {
  std::vector<std::string> out;
  const auto lanes = current_lanes();  // held through the loop: configure() may swap them meanwhile
  for (const auto& l : lanes->topo.lanes) out.push_back(l.name);
  return out;
}

std::string policy() { return current_lanes()->policy; }

Simulation simulate(int devices, int lanes_per_device, const std::string& policy, const std::string& device) {
  capture::StateLock lock;
  auto lanes = current_lanes();
  TORCH_CHECK(lanes_per_device >= 1, "torch_mgpu.simulate: lanes_per_device must be >= 1, got ", lanes_per_device);
  TORCH_CHECK(devices >= 1, "torch_mgpu.simulate: devices must be >= 1, got ", devices);
  plan::Topology topo;
  plan::CostModel gpu;
  if (!device.empty()) {
    gpu = plan::gpu_cost_model(plan::device_profile(device));
    std::vector<std::string> names;
    for (int d = 0; d < devices; ++d) names.push_back("cuda:" + std::to_string(d));
    topo = plan::make_topology(names, lanes_per_device, host_cores());
  } else {
    topo = plan::virtual_topology(lanes->topo, devices, lanes_per_device);
  }
  std::vector<ir::Value> roots;
  for (auto* b : collect()) roots.push_back(b->value);
  ir::Graph g = ir::build_graph(roots);
  const auto& cm = device.empty() ? cost_model() : gpu;
  plan::Plan p = plan::make_plan(g, topo, cm, policy.empty() ? lanes->policy : policy);
  auto e = plan::estimate(g, topo, cm);
  Simulation s;
  s.makespan = p.predicted_makespan;
  s.lower_bound = e.lower_bound;
  s.critical_path = e.critical_path;
  s.total_work = e.total_work;
  s.plan = describe(g, p, nullptr);
  return s;
}

// Building and planning may throw: then nothing ran, and the nodes stay
// pending. Execution never throws (a node that fails fails alone), and once
// it has begun the results must be bound whatever happens after: an
// in-place write that ran must not run again.
void Execution::run() {
  auto t0 = clock::now();
  g = ir::build_graph(roots);
  auto t1 = clock::now();
  plan = plan_for(g, *lanes);
  counters().syncs++;
  auto t2 = clock::now();
  result = runtime::execute(g, *plan, lanes->places);
  ran = true;
  try {
    record = engine::describe(g, *plan, &result);
    learn(g, *lanes, plan, result);
  } catch (const std::exception&) {
    // What the plan did and learned is lost (memory ran out); the results
    // are not.
  }
  auto t3 = clock::now();
  counters().sync_graph_us += micros(t0, t1);
  counters().sync_plan_us += micros(t1, t2);
  counters().sync_execute_us += micros(t2, t3);
}

// Binds an execution's results: each root value becomes the Data (or Error)
// leaf it resolved to, in the live storages that hold it and in the nodes
// recorded since it started (a flight runs while capture goes on, and new
// nodes may read its roots). Under the state lock, with nothing running.
void bind(Execution& e) {
  auto t0 = clock::now();
  const ir::Graph& g = e.g;
  observe_executed(g, e.result);
  auto in_graph = [&](const ir::Value& v) { return g.find(v.node.get()) >= 0; };
  // (node, output) -> leaf, for every root
  std::map<std::pair<const ir::Node*, int>, ir::Value> leaf;
  for (const auto& r : g.roots)
    if (in_graph(r) && !leaf.count({r.node.get(), r.index}))
      leaf.emplace(std::make_pair(r.node.get(), r.index), resolve(r, g, e.result));
  auto leaf_of = [&](const ir::Value& v) -> ir::Value {
    auto it = leaf.find({v.node.get(), v.index});
    if (it != leaf.end()) return it->second;
    // Only roots can be read from outside the graph; anything else is a bug,
    // reported on read rather than by crashing.
    return ir::Value{ir::make_error("mgpu: a value computed in the background was not kept", v.node->outputs[v.index].nbytes), 0};
  };
  std::vector<ir::Node*> newer;  // pending nodes outside the graph
  std::unordered_set<const ir::Node*> seen;
  for (auto* b : capture::pending_buffers()) {
    if (in_graph(b->value)) b->value = leaf_of(b->value);
    else if (seen.insert(b->value.node.get()).second) newer.push_back(b->value.node.get());
  }
  // Nodes recorded since the execution started read its roots: point them
  // at the leaves. Walks only nodes outside the graph.
  while (!newer.empty()) {
    ir::Node* n = newer.back();
    newer.pop_back();
    for (auto& v : n->operands) {
      if (!v.node) continue;
      if (in_graph(v)) v = leaf_of(v);
      else if (v.node->is_pending() && seen.insert(v.node.get()).second) newer.push_back(v.node.get());
    }
  }
  last_plan_slot() = e.record;
  for (auto& n : g.nodes) ir::mark_executed(*n);
  counters().sync_bind_us += micros(t0, clock::now());
}

std::vector<ir::Value> pending_roots() {
  std::vector<ir::Value> roots;
  for (auto* b : collect()) roots.push_back(b->value);
  return roots;
}

} // namespace engine

namespace capture {

namespace {
// Read by every capture, set from any thread: atomic.
std::atomic<int64_t>& max_pending_slot() {
  static std::atomic<int64_t> n{[] {
    const char* e = std::getenv("TORCH_MGPU_MAX_PENDING");
    return e ? std::max<int64_t>(1, std::atoll(e)) : int64_t{100000};
  }()};
  return n;
}
} // namespace

int64_t max_pending_ops() { return max_pending_slot(); }
void set_max_pending_ops(int64_t n) {
  TORCH_CHECK(n > 0, "max_pending_ops must be positive, got ", n);
  max_pending_slot() = n;
}

void sync_all() {
  StateLock lock;
  engine::finish_flight();  // a flight binds first: the sync computes what is still pending
  engine::Execution e;
  e.roots = engine::pending_roots();
  if (!e.roots.empty()) {
    // The graph runs under the settings its ops were called with (one set
    // per graph: capture::record_call cuts the graph where they change).
    ir::CallStateGuard settings(e.roots.front().node->state);
    e.run();
    engine::bind(e);
  }
  std::exception_ptr error = engine::take_background_error();  // it happened first
  if (!error) error = e.result.first_error;
  if (error) std::rethrow_exception(error);
}

c10::Storage materialize(const c10::Storage& mgpu_storage) {
  StateLock lock;
  auto* b = buffer_of(mgpu_storage);
  if (b->value.node->is_pending()) sync_all();
  const auto& n = *b->value.node;
  switch (n.kind) {
    case ir::NodeKind::Data: {
      // Views of the storage read up to its size: never hand out fewer bytes.
      TORCH_CHECK(n.data.nbytes() >= mgpu_storage.nbytes(), "mgpu: a storage of ", mgpu_storage.nbytes(),
                  " bytes holds a value of ", n.data.nbytes(), " bytes (internal error)");
      if (n.data.device().is_cpu()) return n.data;
      // Computed on a device: the host gets a copy, and the storage keeps
      // both (lanes on that device read the device bytes with no transfer).
      c10::Storage host = runtime::copy_to(n.data, c10::Device(c10::kCPU));
      auto leaf = ir::make_data(host);
      leaf->add_replica(n.data);
      for (const auto& r : n.replicas())
        if (!r.device().is_cpu()) leaf->add_replica(r);
      b->value = ir::Value{leaf, 0};
      return host;
    }
    case ir::NodeKind::Empty: {
      // An uninitialized storage gets bytes for good: those a node already
      // read, if one did (the same storage must not read two ways).
      const size_t nbytes = std::max(n.outputs[0].nbytes, mgpu_storage.nbytes());
      c10::Storage host = n.replica_or(c10::Device(c10::kCPU), [&](const c10::Storage* any) {
        return any ? runtime::copy_to(*any, c10::Device(c10::kCPU)) : runtime::allocate(nbytes);
      });
      if (host.nbytes() < nbytes) {
        c10::Storage grown = runtime::allocate(nbytes);
        std::memcpy(grown.mutable_data(), host.data(), host.nbytes());
        host = grown;
      }
      b->value = ir::Value{ir::make_data(host), 0};
      return host;
    }
    case ir::NodeKind::Error:
      TORCH_CHECK(false, n.error);
    case ir::NodeKind::Op:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "mgpu: storage still pending after sync");
}

} // namespace capture
} // namespace torch_mgpu
