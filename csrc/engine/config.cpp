// Where graphs run: the lanes (from the environment, then configure()), the
// cost model measured once per process, and the stream sanitizer's switch.
#include "engine/at_call.h"
#include "engine/config.h"
#include "engine/replays.h"
#include "ir/env.h"
#include "ir/fork_order.h"
#include "capture/capture.h"
#include "runtime/calibrate.h"
#include "runtime/lanes.h"
#include "runtime/remote.h"
#include "runtime/sanitizer.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <new>
#include <optional>
#include <thread>

namespace torch_mgpu::engine {

int host_cores() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

namespace {

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

// The number the environment variable `name` holds, parsed whole: finite
// and positive (a link's figures; 0 would read as "not measured"); nullopt
// where it is not set.

// Greets each worker rank `t` names (same build on both sides) and
// measures the network to them: a request's round trip, and the bandwidth
// of a few megabytes sent.
void check_remote_devices(plan::Topology& t) {
  constexpr size_t kProbe = 4 << 20;
  std::vector<double> trips, rates;
  for (const auto& lane : t.lanes) {
    if (lane.rank == 0) continue;
    auto rem = runtime::remote(lane.rank);
    const auto info = rem->hello();
    TORCH_CHECK(info.version == runtime::wire_version() && info.torch_version == runtime::torch_version(),
                "torch_mgpu: rank ", lane.rank, " runs ", info.version, " with torch ", info.torch_version,
                ", and this process ", runtime::wire_version(), " with torch ", runtime::torch_version(),
                ": start every rank from the same installation");
    const auto& name = t.devices[lane.device];
    const auto there = runtime::device_on_rank(name);
    TORCH_CHECK(!there.is_cuda() || there.index() < info.cuda_devices, "torch_mgpu: device '", name,
                "' does not exist (rank ", lane.rank, " sees ", info.cuda_devices, " CUDA device(s))");
    double best = 1e9;
    for (int k = 0; k < 8; ++k) best = std::min(best, rem->ping());
    const double took = rem->probe_bandwidth(kProbe);
    trips.push_back(best);
    rates.push_back(static_cast<double>(kProbe) / std::max(1e-6, took - best));
  }
  // TORCH_MGPU_NETWORK_GBPS sets the bandwidth (GB/s) where the probe's
  // figure is not the one to plan for (a link shared with other traffic);
  // TORCH_MGPU_NETWORK_LATENCY_US the latency (below). Both are checked
  // before anything is probed.
  const std::optional<double> set_gbps = ir::env::positive_number(ir::env::Var::NetworkGbps);
  const std::optional<double> set_latency_us = ir::env::positive_number(ir::env::Var::NetworkLatencyUs);
  if (trips.empty()) return;
  // A value that crosses ranks mid-run also waits for the threads that
  // carry it (the transport's, the receiving lane's) to get a core while
  // both processes compute: on a loaded machine a scheduler time slice,
  // far above an idle round trip (measured on 2 cores: plans made with
  // the idle figure, ~50 us, cut kNN's chains between ranks and ran 0.8x
  // one rank; with 1 ms, 1.4-1.9x). Plans use at least that;
  // TORCH_MGPU_NETWORK_LATENCY_US sets the figure.
  constexpr double kBusyLatency = 1e-3;
  t.link_latency_s = std::max(kBusyLatency, *std::max_element(trips.begin(), trips.end()) / 2);
  if (set_latency_us) t.link_latency_s = *set_latency_us * 1e-6;
  t.link_bytes_per_s = *std::min_element(rates.begin(), rates.end());
  if (set_gbps) t.link_bytes_per_s = *set_gbps * 1e9;
}

// The devices a topology string names, checked against what this machine has.
// (Devices of other ranks are checked by check_remote_devices.)
void check_devices(const plan::Topology& t) {
  if (!t.cuda) return;
  const int visible = runtime::cuda_device_count();
  for (const auto& d : t.devices) {
    if (d.rfind("rank", 0) == 0) continue;
    TORCH_CHECK(visible > 0, "torch_mgpu: CUDA lanes need a CUDA device, and none is available ",
                "(a CPU build of torch, or no GPU); use cpu devices");
    auto dev = runtime::physical_device(d);
    TORCH_CHECK(dev.index() < visible, "torch_mgpu: device '", d, "' does not exist (", visible,
                " CUDA device(s) visible)");
  }
}

// Where CUDA is available, every visible device with a few streams each
// (TORCH_MGPU_LANES overrides); else one CPU lane per core.
constexpr int kStreamsPerDevice = 4;

} // namespace

Config::Config() {
  ir::env::check_all();  // an invalid TORCH_MGPU_* raises here, at the first use
  const auto d = ir::env::text(ir::env::Var::Devices);
  std::vector<std::string> devices;
  if (d) {
    devices = split(*d);
  } else {
    for (int k = 0; k < runtime::cuda_device_count(); ++k) devices.push_back("cuda:" + std::to_string(k));
    if (devices.empty()) devices.push_back("cpu");
  }
  const auto lanes_per_device = ir::env::integer(ir::env::Var::Lanes, default_lanes(devices));
  lanes = make_lanes(checked_topology(devices, static_cast<int>(lanes_per_device)),
                     ir::env::choice(ir::env::Var::Policy));
  // A fork() while the background worker plans under `m` would leave it
  // held in the child, whose first sync needs it: fork waits for it.
  ir::on_fork(ir::ForkRank::Config, [] { config().m.lock(); }, [] { config().m.unlock(); }, [] { config().m.unlock(); });
}

int Config::default_lanes(const std::vector<std::string>& devices) {
  if (!devices.empty() && devices[0].rfind("cuda", 0) == 0) return kStreamsPerDevice;
  return std::max(1, host_cores() / static_cast<int>(devices.size()));
}

plan::Topology Config::checked_topology(const std::vector<std::string>& devices, int lanes) {
  auto t = plan::make_topology(devices, lanes, host_cores());
  check_devices(t);
  if (t.remote) check_remote_devices(t);
  // Devices of one topology are taken to be alike, and the cost model
  // measures this process's first one.
  TORCH_CHECK(!t.cuda || t.lanes.at(0).rank == 0,
              "torch_mgpu: CUDA devices of other ranks are planned with this process's GPU as their model: name one "
              "of its own first (e.g. ['cuda:0', 'rank1:cuda:0'])");
  return t;
}

std::shared_ptr<const Lanes> Config::make_lanes(plan::Topology t, std::string policy) {
  auto l = std::make_shared<Lanes>();
  l->places = runtime::make_places(t);
  l->topo = std::move(t);
  l->policy = std::move(policy);
  return l;
}

Config& config() {
  static auto* c = new Config();
  return *c;
}

std::shared_ptr<const Lanes> current_lanes() {
  auto& c = config();
  std::lock_guard<std::mutex> lock(c.m);
  return c.lanes;
}

namespace {
// A cost model measured once per process. Not a function-local static: fork()
// while another thread measures (a background flight's first plan, say) would
// leave the static's guard taken forever in the child. fork() waits for a
// measurement in progress (the prepare handler waits for the state to leave
// Measuring and holds the lock through the fork): its parallel ATen and BLAS
// calls may hold locks of those libraries, which the child would inherit
// held (a child hung in its first product, rarely, in CI). So the child has
// the parent's model, or none begun (then measures its own), never one
// begun and lost.
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
    model_ = std::move(measured);
    state_ = State::Done;
    cv_.notify_all();
    return model_;
  }

  void before_fork() {
    std::unique_lock<std::mutex> lock(m_);
    cv_.wait(lock, [&] { return state_ != State::Measuring; });
    lock.release();  // held through the fork
  }
  void after_fork_in_parent() { m_.unlock(); }
  void after_fork_in_child() {
    new (&m_) std::mutex();  // locked by the prepare handler
    new (&cv_) std::condition_variable();
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
  ir::on_fork(
      ir::ForkRank::WaitForWork,
      [] {
        cpu_model().before_fork();
        device_model().before_fork();
      },
      [] {
        device_model().after_fork_in_parent();
        cpu_model().after_fork_in_parent();
      },
      [] {
        cpu_model().after_fork_in_child();
        device_model().after_fork_in_child();
      });
  return true;
}();
} // namespace

namespace {
// The pinned model, read at every plan: an atomically swapped pointer (no
// lock a fork could catch held).
std::shared_ptr<const plan::CostModel>& pinned_model() {
  static std::shared_ptr<const plan::CostModel> p;
  return p;
}
} // namespace

void pin_cost_model(std::optional<plan::CostModel> cm) {
  capture::StateLock lock;
  sync_all();  // pending work runs under the plans it was recorded for
  std::shared_ptr<const plan::CostModel> next;
  if (cm) next = std::make_shared<const plan::CostModel>(*cm);
  std::atomic_store(&pinned_model(), std::move(next));
  auto& c = config();
  std::lock_guard<std::mutex> config_lock(c.m);
  c.plans.clear();
}

bool cost_model_pinned() { return static_cast<bool>(std::atomic_load(&pinned_model())); }

plan::CostModel cost_model() {
  static const bool skip = ir::env::is_set(ir::env::Var::NoCalibration);
  auto lanes = current_lanes();
  if (auto pinned = std::atomic_load(&pinned_model())) return plan::with_link(*pinned, lanes->topo);
  if (lanes->topo.cuda) {
    // Devices of one topology are taken to be alike: the first one is measured.
    const auto device = lanes->places.at(0).device;
    return plan::with_link(
        device_model().get([&] { return skip ? plan::CostModel() : runtime::calibrate_device(device); }), lanes->topo);
  }
  return plan::with_link(
      cpu_model().get([&] { return skip ? plan::CostModel() : runtime::calibrate_cpu(host_cores()); }), lanes->topo);
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
  sync_all();  // pending work runs where it was planned to (and no flight runs on)
  auto next = Config::make_lanes(std::move(topo), policy.empty() ? now->policy : policy);
  at_call::forget();  // the ways were measured on the lanes before
  auto& c = config();
  std::lock_guard<std::mutex> config_lock(c.m);
  c.lanes = std::move(next);
  c.plans.clear();
  clear_replays();  // recordings hold the lanes' places
}

void start_stream_sanitizer() {
  capture::StateLock lock;
  TORCH_CHECK(!current_lanes()->topo.cuda,
              "torch_mgpu: the stream sanitizer checks CPU lanes run as stream lanes; configure CPU devices first "
              "(torch_mgpu.configure(devices=['cpu', 'cpu']))");
  sync_all();  // what is pending runs on the host lanes it was planned for
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
    sync_all();
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

} // namespace torch_mgpu::engine
