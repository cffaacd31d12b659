// Tiered execution (see tiers.h): hot graphs, the compile queue, tier-1 runs
// and the measured choice between the tiers.
#include "engine/tiers.h"
#include "ir/fork_order.h"

#include "capture/lazy_tensor.h"
#include "engine/plan_cache.h"
#include "ir/held_bytes.h"
#include "ir/partition.h"
#include "runtime/counters.h"
#include "runtime/lanes.h"
#include "runtime/place.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <pthread.h>
#include <unordered_map>
#include <unordered_set>

namespace torch_mgpu::engine {
namespace {

constexpr int kTrialRuns = 3;       // timed tier-1 runs (after an untimed first) that decide
constexpr size_t kTier0Runs = 5;    // tier-0 times kept to compare with
constexpr double kMargin = 1.05;    // tier 1 is kept only if this much faster
constexpr size_t kMaxEntries = 256; // graphs remembered; the least recently used goes
// Kept code whose recent runs (the median of this many) take this many
// times its trial's median goes back to tier 0 for fresh measurements, then
// through a second trial: the machine may have got busier, or the graph's
// inputs larger, since the code was kept.
constexpr size_t kRecentRuns = 8;
constexpr double kSlowdown = 2.0;

enum class State { Cold, Queued, Trial, Kept, Remeasure, Rejected };

struct Entry {
  int hits = 0;
  State state = State::Cold;
  std::shared_ptr<const CompileRequest> request;  // while queued or compiling
  std::vector<uint64_t> first_values;  // each constant's exact hash at the first tier-0 run
  std::shared_ptr<const CompiledGraph> compiled;
  std::vector<double> tier0, tier1;  // seconds
  std::vector<double> recent;         // kept code's latest runs
  double kept_median = 0;             // its trial's median
  int tier1_runs = 0;
  uint64_t used = 0;
};

struct Tiers {
  std::mutex m;
  std::condition_variable cv;
  std::unordered_map<uint64_t, Entry> entries;
  std::deque<std::shared_ptr<const CompileRequest>> queue;
  int compiling = 0;
  bool stopped = false;
  bool compiler = false;  // a compile thread serves the queue
  std::string last_error;  // why the last graph was dropped from tier 1
  uint64_t clock = 0;
};

Tiers* g_tiers = nullptr;

Tiers& tiers() {
  static const bool made = [] {
    g_tiers = new Tiers();  // leaked: the compile thread may wait on it at exit
    // A forked child has no compile thread: its queue and its graphs start
    // empty, its mutex free. The parent's compiled code is left as it is
    // (not destroyed: that would take the GIL in the child).
    ir::on_fork(ir::ForkRank::Tiers, [] { g_tiers->m.lock(); }, [] { g_tiers->m.unlock(); }, [] {
      new (&g_tiers->m) std::mutex();
      new (&g_tiers->cv) std::condition_variable();
      new (&g_tiers->entries) std::unordered_map<uint64_t, Entry>();
      g_tiers->queue.clear();
      g_tiers->compiling = 0;
      g_tiers->compiler = false;
    });
    return true;
  }();
  (void)made;
  return *g_tiers;
}

// Whether compiled code is on trial (else kept as soon as it is compiled).
std::atomic<bool>& trial_slot() {
  static std::atomic<bool> on{true};
  return on;
}

std::atomic<int>& hits_slot() {
  static std::atomic<int> n{[] {
    const char* e = std::getenv("TORCH_MGPU_COMPILE");
    if (e == nullptr || *e == '\0') return 0;
    if (!std::strcmp(e, "off") || !std::strcmp(e, "0")) return 0;
    if (!std::strcmp(e, "on")) return 2;
    return std::max(0, std::atoi(e));
  }()};
  return n;
}

// A Python number passed where a tensor goes (`x * 2`): a 0-dim CPU tensor.
bool wrapped_number(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().defined() && v.toTensor().dim() == 0 && v.toTensor().device().is_cpu() &&
      v.toTensor().layout() == at::kStrided;
}

// Floating and complex constants by value: the structural hash sees them by
// class only (so that plans are shared), compiled code bakes them in.
uint64_t exact_hash(const c10::IValue& v) {
  if (v.isDouble()) {
    const double d = v.toDouble();
    uint64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    return bits;
  }
  if (v.isComplexDouble()) {
    const auto c = v.toComplexDouble();
    return ir::hash_combine(exact_hash(c.real()), exact_hash(c.imag()));
  }
  if (v.isScalar()) {
    const auto s = v.toScalar();
    if (s.isFloatingPoint()) return exact_hash(s.toDouble());
    if (s.isComplex()) return exact_hash(c10::IValue(s.toComplexDouble()));
    return 0;
  }
  if (v.isList()) {
    uint64_t h = 0x51;
    for (const auto& e : v.toListRef()) h = ir::hash_combine(h, exact_hash(e));
    return h;
  }
  if (wrapped_number(v)) {
    const auto& t = v.toTensor();
    return ir::hash_combine(static_cast<uint64_t>(t.scalar_type()), exact_hash(c10::IValue(t.item())));
  }
  if (v.isDoubleList()) {
    uint64_t h = 0x52;
    for (double d : v.toDoubleVector()) h = ir::hash_combine(h, exact_hash(d));
    return h;
  }
  return 0;
}

// Graphs are counted, queued and compiled by structure (the plan cache's
// hash: floating constants by class).
uint64_t key_of(const ir::Graph& g) { return g.hash; }

bool is_lifted(const std::vector<std::pair<int, int>>& lifted, int node, int arg) {
  return std::find(lifted.begin(), lifted.end(), std::make_pair(node, arg)) != lifted.end();
}

// The exact values of the constants that are not `lifted`: what compiled
// code bakes in.
template <typename Nodes, typename ArgsOf>
uint64_t fixed_hash(const Nodes& nodes, ArgsOf args_of, const std::vector<std::pair<int, int>>& lifted) {
  uint64_t h = 0x7131;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const auto& args = args_of(nodes[i]);
    for (size_t k = 0; k < args.size(); ++k)
      if (args[k].kind == ir::Arg::Kind::Constant && !is_lifted(lifted, static_cast<int>(i), static_cast<int>(k)))
        h = ir::hash_combine(h, exact_hash(args[k].constant));
  }
  return h;
}

uint64_t fixed_hash(const ir::Graph& g, const std::vector<std::pair<int, int>>& lifted) {
  return fixed_hash(g.nodes, [](const ir::NodePtr& n) -> c10::ArrayRef<ir::Arg> { return n->args; }, lifted);
}

uint64_t fixed_hash(const CompileRequest& r, const std::vector<std::pair<int, int>>& lifted) {
  return fixed_hash(r.nodes, [](const CompileRequest::Node& n) -> c10::ArrayRef<ir::Arg> { return n.args; },
                    lifted);
}

// Each constant argument's exact hash, in node and argument order.
std::vector<uint64_t> constant_values(const ir::Graph& g) {
  std::vector<uint64_t> out;
  for (const auto& n : g.nodes)
    for (const auto& a : n->args)
      if (a.kind == ir::Arg::Kind::Constant) out.push_back(exact_hash(a.constant));
  return out;
}

// The constants whose values differ from `first`.
std::vector<std::pair<int, int>> varying_constants(const ir::Graph& g, const std::vector<uint64_t>& first) {
  std::vector<std::pair<int, int>> out;
  size_t at = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const auto& args = g.nodes[i]->args;
    for (size_t k = 0; k < args.size(); ++k) {
      if (args[k].kind != ir::Arg::Kind::Constant) continue;
      if (at >= first.size() || first[at] != exact_hash(args[k].constant))
        out.emplace_back(static_cast<int>(i), static_cast<int>(k));
      ++at;
    }
  }
  return out;
}

// A lifted constant's value as the compiled code takes it.
at::Tensor lifted_input(const c10::IValue& v) {
  double d = 0;
  if (v.isDouble()) d = v.toDouble();
  else if (v.isScalar()) d = v.toScalar().toDouble();
  else if (v.isTensor()) d = v.toTensor().item().toDouble();
  else TORCH_CHECK(false, "mgpu: a constant compiled as an input is not a number");
  return at::scalar_tensor(d, at::TensorOptions().dtype(at::kDouble));
}

// The leaves (values read from outside the graph) in first-use order, and the
// roots the graph computes, without repeats: the order compiled code takes
// and returns them in, the same for every graph of one key.
struct Layout {
  std::vector<ir::Value> leaves;
  std::vector<std::pair<int, int>> roots;  // (node, output)
};

Layout layout_of(const ir::Graph& g) {
  Layout lay;
  std::unordered_map<const ir::Node*, std::vector<int>> seen;  // leaf node -> outputs taken
  for (const auto& n : g.nodes)
    for (const auto& v : n->operands) {
      if (g.find(v.node.get()) >= 0) continue;
      auto& outs = seen[v.node.get()];
      if (std::find(outs.begin(), outs.end(), v.index) != outs.end()) continue;
      outs.push_back(v.index);
      lay.leaves.push_back(v);
    }
  std::unordered_set<uint64_t> taken;
  for (const auto& r : g.roots) {
    const int i = g.find(r.node.get());
    if (i < 0) continue;
    if (taken.insert((static_cast<uint64_t>(i) << 20) ^ static_cast<uint64_t>(r.index)).second)
      lay.roots.emplace_back(i, r.index);
  }
  return lay;
}

int leaf_number(const Layout& lay, const ir::Value& v) {
  for (size_t k = 0; k < lay.leaves.size(); ++k)
    if (lay.leaves[k] == v) return static_cast<int>(k);
  return -1;
}

size_t stored_bytes(const ir::Value& v) {
  const auto& n = *v.node;
  return n.kind == ir::NodeKind::Data ? n.data.nbytes() : n.outputs.at(v.index).nbytes;
}

bool plain_constant(const c10::IValue& v) {
  if (wrapped_number(v) || (v.isTensor() && !v.toTensor().defined())) return true;  // a number; None
  if (v.isGenerator() || v.isTensor() || v.isObject() || v.isCapsule() || v.isFuture()) return false;
  if (v.isCustomClass() || ir::partition_of(v) != nullptr) return false;
  if (v.isList())
    for (const auto& e : v.toListRef())
      if (!plain_constant(e)) return false;
  return true;
}

// Why tier 1 may not run `g` on lanes `l` (see tiers.h), or "" when it may.
std::string ineligible(const ir::Graph& g, const Lanes& l) {
  if (l.topo.cuda || stream_lanes(l)) return "CUDA or stream lanes";
  if (g.size() < 2) return "a graph of one op";
  for (const auto& p : l.places)
    if (!p.device.is_cpu()) return "lanes off the host";
  const ir::CallState plain;
  for (const auto& n : g.nodes) {
    // Every tier-1 run checks its graph: the reason is made only when there is one.
    auto no = [&](const char* why) { return std::string(n->name) + ": " + why; };
    if (n->kind != ir::NodeKind::Op || !n->op) return no("not an ATen op");
    if (n->seed) return no("random");
    if (n->state != plain) return no("called under non-default settings");
    for (const auto& a : n->args) {
      if (a.kind == ir::Arg::Kind::Constant && !plain_constant(a.constant))
        return no("a constant argument that is not a plain value");
      for (const auto& t : a.tensors)
        if (t && (t->geom.conj || t->geom.neg)) return no("a conjugate or negative view");
    }
    for (const auto& w : n->written) {
      const auto& a = n->args.at(static_cast<size_t>(w.arg));
      const auto& ref = a.kind == ir::Arg::Kind::Tensor ? a.tensors.at(0) : a.tensors.at(static_cast<size_t>(w.element));
      if (!ref) return no("an out= tensor resized");
      // A fresh empty out= tensor the op sizes (`abs`, and the other
      // functional ops whose kernel is empty + out=) replays as the op
      // writing a new tensor; one with bytes before does not.
      if (ref->geom != w.after && stored_bytes(n->operands.at(static_cast<size_t>(ref->operand))) != 0)
        return no("an out= tensor resized");
    }
    for (const auto& v : n->operands) {
      if (g.find(v.node.get()) >= 0) continue;
      const auto kind = v.node->kind;
      if (kind == ir::NodeKind::Data ? !v.node->data.device().is_cpu() : kind != ir::NodeKind::Empty)
        return no("reads bytes off the host");
    }
  }
  return "";
}

bool eligible(const ir::Graph& g, const Lanes& l) { return ineligible(g, l).empty(); }

std::shared_ptr<CompileRequest> request_for(const ir::Graph& g, uint64_t key) {
  auto req = std::make_shared<CompileRequest>();
  req->key = key;
  const Layout lay = layout_of(g);
  for (const auto& v : lay.leaves) {
    CompileRequest::Leaf leaf;
    leaf.nbytes = stored_bytes(v);
    req->leaves.push_back(leaf);
  }
  std::vector<int> first(g.size() + 1, static_cast<int>(lay.leaves.size()));
  for (size_t i = 0; i < g.size(); ++i) first[i + 1] = first[i] + static_cast<int>(g.nodes[i]->outputs.size());
  for (size_t i = 0; i < g.size(); ++i) {
    const auto& n = *g.nodes[i];
    CompileRequest::Node rn{*n.op, {n.args.begin(), n.args.end()}, {}, {n.outputs.begin(), n.outputs.end()}, {}, n.written};
    for (const auto& v : n.operands) {
      const int j = g.find(v.node.get());
      rn.operands.push_back(j >= 0 ? first[j] + v.index : leaf_number(lay, v));
    }
    for (size_t k = 0; k < n.outputs.size(); ++k) rn.output_values.push_back(first[i] + static_cast<int>(k));
    req->nodes.push_back(std::move(rn));
  }
  for (const auto& [i, k] : lay.roots) req->roots.push_back(first[i] + k);
  return req;
}

c10::Storage leaf_bytes(const ir::Value& v) {
  const auto& n = *v.node;
  if (n.kind == ir::NodeKind::Data) return n.data;
  const size_t nbytes = n.outputs.at(v.index).nbytes;
  return n.replica_or(c10::Device(c10::kCPU), [&](const c10::Storage* any) {
    return any ? runtime::copy_to(*any, c10::Device(c10::kCPU)) : runtime::allocate(nbytes);
  });
}

// Runs `c` on `g`'s leaves; the roots' bytes in an ExecResult as tier 0
// would leave them. Throws when the compiled code does (nothing written).
runtime::ExecResult call(const ir::Graph& g, const CompiledGraph& c) {
  const Layout lay = layout_of(g);
  TORCH_CHECK(lay.leaves.size() == c.input_dtypes.size(), "mgpu: a compiled graph takes ", c.input_dtypes.size(),
              " inputs, the graph has ", lay.leaves.size());
  std::vector<at::Tensor> inputs;
  std::unordered_set<const void*> input_bytes;
  for (size_t k = 0; k < lay.leaves.size(); ++k) {
    c10::Storage s = leaf_bytes(lay.leaves[k]);
    const auto dtype = c.input_dtypes[k];
    const int64_t numel = static_cast<int64_t>(s.nbytes() / c10::elementSize(dtype));
    inputs.push_back(at::empty({0}, at::TensorOptions().dtype(dtype)).set_(s, 0, {numel}, {1}));
    input_bytes.insert(s.data());
  }
  for (const auto& [i, k] : c.lifted) inputs.push_back(lifted_input(g.nodes.at(i)->args.at(k).constant));
  runtime::ExecResult r;
  const size_t n = g.size();
  r.values.resize(n);
  r.status.assign(n, runtime::Status::Ok);
  r.started = std::chrono::steady_clock::now();
  std::vector<at::Tensor> outs = c.run(inputs);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.started).count();
  runtime::counters().tier1_call_us += static_cast<int64_t>(seconds * 1e6);
  TORCH_CHECK(outs.size() == lay.roots.size(), "mgpu: a compiled graph returned ", outs.size(), " tensors, expected ",
              lay.roots.size());
  std::unordered_set<const void*> output_bytes;
  for (size_t j = 0; j < outs.size(); ++j) {
    const auto [i, k] = lay.roots[j];
    const ir::Output& o = g.nodes[i]->outputs.at(k);
    const at::Tensor& t = outs[j];
    ir::TensorGeometry geom = o.geom;
    if (o.mutated_operand >= 0) {  // the storage's bytes, flat
      geom = ir::TensorGeometry();
      geom.dtype = t.scalar_type();
      geom.sizes = {static_cast<int64_t>(o.nbytes / t.element_size())};
      geom.strides = {1};
    }
    c10::Storage s;
    const bool own = t.defined() && t.layout() == at::kStrided && t.device().is_cpu() && capture::geometry_of(t) == geom &&
        t.storage().nbytes() >= o.nbytes && !input_bytes.count(t.storage().data()) &&
        output_bytes.insert(t.storage().data()).second;
    if (own) {
      s = t.storage();
    } else {
      TORCH_CHECK(t.defined() && t.numel() * t.element_size() <= static_cast<int64_t>(o.nbytes),
                  "mgpu: a compiled graph returned a tensor that does not fit its value");
      s = runtime::allocate(o.nbytes);
      runtime::view(s, geom).copy_(t);
    }
    ir::hold(s);
    r.values[i].resize(g.nodes[i]->outputs.size());
    r.values[i][k] = std::move(s);
  }
  r.timing.assign(n, runtime::NodeTiming{0, 0.0, seconds, 1});
  r.makespan = seconds;
  return r;
}

// The entry of `key`, made if new (the least recently used one goes when
// there are kMaxEntries). Under t.m: the compiled code of an entry that
// goes is handed to `dropped`, to be let go of after t.m (its deleter takes
// the GIL, and a fork holds the GIL while it takes t.m).
Entry& entry_for(Tiers& t, uint64_t key, std::vector<std::shared_ptr<const CompiledGraph>>& dropped) {
  auto it = t.entries.find(key);
  if (it == t.entries.end()) {
    if (t.entries.size() >= kMaxEntries) {
      auto oldest = t.entries.end();
      for (auto e = t.entries.begin(); e != t.entries.end(); ++e)
        if (e->second.state != State::Queued && (oldest == t.entries.end() || e->second.used < oldest->second.used))
          oldest = e;
      if (oldest != t.entries.end()) {
        if (oldest->second.compiled) dropped.push_back(std::move(oldest->second.compiled));
        t.entries.erase(oldest);
      }
    }
    it = t.entries.emplace(key, Entry()).first;
  }
  it->second.used = ++t.clock;
  return it->second;
}

} // namespace

int compile_hits() { return hits_slot().load(); }
void set_compile_trial(bool on) { trial_slot() = on; }
void set_compile_hits(int hits) {
  TORCH_CHECK(hits >= 0, "compile hits must be >= 0 (0: off), got ", hits);
  hits_slot() = hits;
}

std::shared_ptr<const CompileRequest> next_compile_request() {
  auto& t = tiers();
  std::unique_lock<std::mutex> lock(t.m);
  t.cv.wait(lock, [&] { return t.stopped || !t.queue.empty(); });
  if (t.stopped) return nullptr;
  auto req = t.queue.front();
  t.queue.pop_front();
  t.compiling++;
  return req;
}

void install_compiled(uint64_t key, std::shared_ptr<CompiledGraph> compiled) {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.compiling = std::max(0, t.compiling - 1);
  auto& c = runtime::counters();
  c.tier1_compiled++;
  c.tier1_compile_us += static_cast<int64_t>(compiled->compile_s * 1e6);
  auto it = t.entries.find(key);
  if (it != t.entries.end() && it->second.state == State::Queued && it->second.request) {
    compiled->fixed = fixed_hash(*it->second.request, compiled->lifted);
    it->second.state = trial_slot() ? State::Trial : State::Kept;
    it->second.compiled = std::move(compiled);
    it->second.request.reset();
  }
  t.cv.notify_all();
}

void reject_compiled(uint64_t key, const std::string& why) {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.compiling = std::max(0, t.compiling - 1);
  runtime::counters().tier1_rejected++;
  auto it = t.entries.find(key);
  if (it != t.entries.end()) {
    it->second.state = State::Rejected;
    it->second.request.reset();
  }
  t.last_error = "not compiled: " + why;
  t.cv.notify_all();
}

void stop_compiles() {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.stopped = true;
  t.compiler = false;
  t.queue.clear();
  t.cv.notify_all();
}

bool wait_for_compiles(double seconds) {
  auto& t = tiers();
  std::unique_lock<std::mutex> lock(t.m);
  return t.cv.wait_for(lock, std::chrono::duration<double>(seconds),
                       [&] { return t.queue.empty() && t.compiling == 0; });
}

std::string last_tier_error() {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  return t.last_error;
}

void set_compiler_present(bool present) {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.compiler = present;
  if (present) t.stopped = false;
}

std::optional<runtime::ExecResult> run_tier1(const ir::Graph& g, const Lanes& l, int caller_threads, TierRun& run) {
  if (compile_hits() == 0) return std::nullopt;
  run.key = key_of(g);
  std::shared_ptr<const CompiledGraph> compiled;
  {
    auto& t = tiers();
    std::lock_guard<std::mutex> lock(t.m);
    auto it = t.entries.find(run.key);
    if (it == t.entries.end() || !(it->second.state == State::Trial || it->second.state == State::Kept)) return std::nullopt;
    it->second.used = ++t.clock;
    compiled = it->second.compiled;
  }
  // The same structure on other lanes, or with other values of the
  // constants compiled in: tier 0.
  if (!eligible(g, l) || fixed_hash(g, compiled->lifted) != compiled->fixed) return std::nullopt;
  try {
    // The compiled loops have their threads; the kernels they call (a
    // product) take this thread's, as they would on the syncing thread.
    const int threads = std::clamp(caller_threads, 1, l.topo.cores);
    std::optional<runtime::ScopedParallelism> same;
    if (threads != runtime::thread_parallelism()) same.emplace(threads);
    runtime::ExecResult r = call(g, *compiled);
    run.compiled = std::move(compiled);
    runtime::counters().tier1_runs++;
    return r;
  } catch (const std::exception& e) {
    // Nothing was written: tier 0 runs the graph and raises what it raises.
    auto& t = tiers();
    std::lock_guard<std::mutex> lock(t.m);
    t.last_error = std::string("a compiled run failed: ") + e.what();
    runtime::counters().tier1_fallbacks++;
    auto it = t.entries.find(run.key);
    if (it != t.entries.end()) {
      it->second.state = State::Rejected;
      it->second.compiled.reset();
    }
    return std::nullopt;
  }
}

void observe_tier(const ir::Graph& g, const Lanes& l, const TierRun& run, double seconds, bool failed) {
  const int hits = compile_hits();
  if (hits == 0) return;
  auto& t = tiers();
  const uint64_t key = run.key ? run.key : key_of(g);
  std::vector<std::shared_ptr<const CompiledGraph>> dropped;  // let go of after the lock
  std::unique_lock<std::mutex> lock(t.m);
  Entry& e = entry_for(t, key, dropped);
  if (run.compiled && e.state == State::Kept) {
    if (!trial_slot()) return;  // kept without trials: kept as it is
    e.recent.push_back(seconds);
    if (e.recent.size() > kRecentRuns) e.recent.erase(e.recent.begin());
    if (e.kept_median == 0 && e.recent.size() == kRecentRuns) {
      e.kept_median = median(e.recent);  // kept before trials were on: its first runs are the measure
      e.recent.clear();
      return;
    }
    const double now = e.recent.size() == kRecentRuns ? median(e.recent) : 0;
    if (now > kSlowdown * e.kept_median) {
      t.last_error = "compiled code slowed down (" + std::to_string(now * 1e6) + " us, " +
          std::to_string(e.kept_median * 1e6) + " us in its trial): tier 0 is measured again for a second trial";
      e.state = State::Remeasure;
      e.tier0.clear();
      e.recent.clear();
    }
    return;
  }
  if (run.compiled) {
    if (e.state != State::Trial) return;
    if (e.tier1_runs++ == 0) return;  // the first call is cold
    e.tier1.push_back(seconds);
    if (static_cast<int>(e.tier1.size()) < kTrialRuns) return;
    const bool faster = !e.tier0.empty() && median(e.tier1) * kMargin < median(e.tier0);
    e.state = faster ? State::Kept : State::Rejected;
    e.kept_median = median(e.tier1);
    if (!faster) {
      t.last_error = "compiled code ran no faster than tier 0 (" + std::to_string(median(e.tier1) * 1e6) + " us, tier 0 " +
          (e.tier0.empty() ? std::string("unmeasured") : std::to_string(median(e.tier0) * 1e6) + " us") + ")";
      e.compiled.reset();
      runtime::counters().tier1_rejected++;
    }
    return;
  }
  if (failed) return;  // an error is no measure of the graph
  if (e.state == State::Rejected || e.state == State::Kept) return;
  e.tier0.push_back(seconds);
  if (e.tier0.size() > kTier0Runs) e.tier0.erase(e.tier0.begin());
  if (e.state == State::Remeasure) {
    if (e.tier0.size() >= static_cast<size_t>(kTrialRuns)) {  // then the compiled code's second trial
      e.state = State::Trial;
      e.tier1.clear();
      e.tier1_runs = 1;  // warm: no untimed run
    }
    return;
  }
  if (e.state != State::Cold) return;
  if (++e.hits == 1) {
    lock.unlock();
    std::vector<uint64_t> first = constant_values(g);
    lock.lock();
    entry_for(t, key, dropped).first_values = std::move(first);
    return;
  }
  if (e.hits < hits || !t.compiler) return;
  std::vector<uint64_t> first = e.first_values;
  lock.unlock();
  const std::string why = ineligible(g, l);
  std::shared_ptr<CompileRequest> req = why.empty() ? request_for(g, key) : nullptr;
  if (req) req->varying = varying_constants(g, first);
  lock.lock();
  Entry& again = entry_for(t, key, dropped);
  if (again.state != State::Cold) return;
  if (!req) {
    again.state = State::Rejected;
    t.last_error = "not compiled: " + why;
    return;
  }
  again.state = State::Queued;
  again.request = req;
  runtime::counters().tier1_hot++;
  t.queue.push_back(std::move(req));
  t.cv.notify_all();
}

} // namespace torch_mgpu::engine
