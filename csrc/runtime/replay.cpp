#include "runtime/replay.h"

#include "ir/errors.h"
#include "runtime/lanes.h"
#include "runtime/observer.h"
#include "runtime/run_node.h"

#include <ATen/ThreadLocalState.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

#ifdef TORCH_MGPU_USE_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/version.h>

#include <map>
#endif

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace torch_mgpu::runtime {

namespace {
std::string mib(size_t bytes) {
  return std::to_string((bytes + (size_t(1) << 20) - 1) >> 20) + " MiB";
}
} // namespace

std::optional<std::string> replay_blocker(const ir::Graph& g, const plan::Plan& p, const std::vector<Place>& places,
                                          const ReplayLimits& limits) {
  if (g.nodes.empty()) return "no op to run";
  const std::set<int> lanes(p.lane_of.begin(), p.lane_of.end());
  std::optional<c10::Device> device;
  for (int l : lanes) {
    const Place& place = places.at(static_cast<size_t>(l));
    if (place.is_remote()) return "lane " + std::to_string(l) + " is on another process";
    if (!place.on_stream()) return "lane " + std::to_string(l) + " is a host lane (" + place.device.str() + "): only stream lanes are captured";
    if (device && *device != place.device)
      return "the lanes are on more than one device (" + device->str() + ", " + place.device.str() + ")";
    device = place.device;
  }
  size_t made = 0;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const ir::Node& n = *g.nodes[i];
    const Place& place = places[static_cast<size_t>(p.lane_of[i])];
    if (!runs_on(n, place))
      return describe_node(n) + " has no kernel for " + place.device.str() + ": it would run on the host";
    if (n.seed) return describe_node(n) + " draws random numbers: a replay would draw the same ones again";
    for (const auto& a : n.args)
      if (a.kind == ir::Arg::Kind::Constant && a.constant.isGenerator())
        return describe_node(n) + " draws random numbers from a generator seeded at its call: a replay would draw "
                                  "from the recorded call's";
    for (const auto& o : n.outputs) made += o.nbytes;
  }
  if (made > limits.pool_bytes)
    return "its values need " + mib(made) + ", more than a graph's pool holds (" + mib(limits.pool_bytes) + ")";
  return std::nullopt;
}

namespace {
// Why the CUDA kernel of `n` reads a value on the host, nullopt where it
// does not (as far as is known: a capture that fails still says why).
std::optional<std::string> host_read_of(const ir::Node& n) {
  // By name without the overload: linear algebra that checks its result
  // (_linalg_check_errors, a sync on CUDA), and ops that read values on the
  // host (their result's size depends on them; matrix_exp's norm).
  // (linalg_cholesky and linalg_inv replay unchecked: unchecked_call_of.)
  static const std::unordered_set<std::string_view> checking = {
      "aten::cholesky", "aten::inverse", "aten::cholesky_inverse", "aten::linalg_solve",
      "aten::linalg_lu_factor", "aten::linalg_ldl_factor", "aten::linalg_eigh", "aten::linalg_eigvalsh",
      "aten::_linalg_eigh", "aten::linalg_eig", "aten::linalg_eigvals", "aten::linalg_svd", "aten::linalg_svdvals",
      "aten::_linalg_svd", "aten::svd", "aten::linalg_pinv", "aten::linalg_matrix_rank", "aten::linalg_lstsq",
      "aten::linalg_cond", "aten::_linalg_check_errors"};
  static const std::unordered_set<std::string_view> sized_by_values = {
      "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim",
      "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount", "aten::repeat_interleave",
      "aten::_local_scalar_dense", "aten::item", "aten::linalg_matrix_exp"};
  const std::string_view name = n.name.substr(0, n.name.find('.'));
  if (checking.count(name)) return std::string("checks its result on the host");
  if (sized_by_values.count(name)) return std::string("reads values on the host");
  if (!n.op) return std::nullopt;
  const auto& schema = n.op->schema();
  auto constant = [&](const char* arg) -> const c10::IValue* {
    const auto k = schema.argumentIndexWithName(arg);
    if (!k || static_cast<size_t>(*k) >= n.args.size()) return nullptr;
    const ir::Arg& a = n.args[static_cast<size_t>(*k)];
    return a.kind == ir::Arg::Kind::Constant ? &a.constant : nullptr;
  };
  // The _ex forms check only when asked.
  if (const auto* check = constant("check_errors"); check && check->isBool() && check->toBool())
    return std::string("checks its result on the host (check_errors=True)");
  // histc with min == max takes its range from its input's values.
  if (name == "aten::histc") {
    const auto* lo = constant("min");
    const auto* hi = constant("max");
    if (lo && hi && lo->isScalar() && hi->isScalar() && lo->toScalar().toDouble() == hi->toScalar().toDouble())
      return std::string("reads its input's range on the host (min == max)");
  }
  return std::nullopt;
}
} // namespace

std::optional<std::string> capture_blocker(const ir::Graph& g, const plan::Plan& p, const std::vector<Place>& places) {
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Place& place = places.at(static_cast<size_t>(p.lane_of[i]));
    if (!place.device.is_cuda()) continue;
    if (auto why = host_read_of(*g.nodes[i]))
      return describe_node(*g.nodes[i]) + " " + *why + " on " + place.device.str() +
          ": a CUDA graph cannot hold a sync";
  }
  return std::nullopt;
}

ir::NodePtr call_of(const ir::Node& n) {
  ir::NodePtr c = ir::new_node();
  c->kind = n.kind;
  c->name = n.name;
  c->op = n.op;
  c->args = n.args;
  c->outputs = n.outputs;
  c->seed = n.seed;
  c->state = n.state;
  c->grad_mode = n.grad_mode;
  c->call_threads = n.call_threads;
  c->written = n.written;
  c->where = n.where;
  c->id = n.id;
  return c;
}

namespace {
// Ops whose check a replay leaves to its end, and their unchecked forms
// (the same arguments, then check_errors; the same results, then the
// error codes).
struct Unchecked {
  std::string_view op, unchecked;
};
constexpr Unchecked kUnchecked[] = {{"aten::linalg_cholesky", "aten::linalg_cholesky_ex"},
                                    {"aten::linalg_inv", "aten::linalg_inv_ex"}};
} // namespace

ir::NodePtr unchecked_call_of(const ir::Node& n) {
  if (n.kind != ir::NodeKind::Op || n.outputs.size() != 1 || n.outputs[0].mutated_operand >= 0) return nullptr;
  for (const auto& u : kUnchecked) {
    if (n.name != u.op) continue;
    const ir::TensorGeometry& result = n.outputs[0].geom;
    if (result.sizes.size() < 2) return nullptr;
    ir::NodePtr c = call_of(n);
    c->name = ir::intern(u.unchecked);
    c->op = c10::Dispatcher::singleton().findSchemaOrThrow(u.unchecked.data(), "");
    ir::Arg no_check;
    no_check.constant = false;
    c->args.push_back(std::move(no_check));
    // The error codes: int32, one per matrix of the batch, contiguous.
    ir::Output codes;
    codes.returned = 1;
    codes.geom.dtype = c10::ScalarType::Int;
    codes.geom.sizes.assign(result.sizes.begin(), result.sizes.end() - 2);
    const auto strides = c10::contiguous_strides(codes.geom.sizes);
    codes.geom.strides.assign(strides.begin(), strides.end());
    codes.nbytes = static_cast<size_t>(c10::multiply_integers(codes.geom.sizes)) * sizeof(int32_t);
    c->outputs.push_back(codes);
    return c;
  }
  return nullptr;
}

void raise_failed_checks(const Recording& r) {
  // Every check's codes in one read from the device (one copy, one sync).
  std::vector<at::Tensor> codes;
  for (const auto& check : r.checks)
    codes.push_back(byte_view(check.codes, check.codes.nbytes()).view(at::kInt));
  if (codes.empty()) return;
  const at::Tensor all = (codes.size() == 1 ? codes[0] : at::cat(codes)).to(at::kCPU);
  const int32_t* code = all.data_ptr<int32_t>();
  for (size_t c = 0; c < r.checks.size(); ++c)
    for (int64_t k = 0; k < codes[c].numel(); ++k, ++code)
      TORCH_CHECK(*code == 0, "mgpu: ", r.checks[c].node, " failed its check in a replay (error code ", *code,
                  "): the graph runs anew");
}

size_t Recording::pool_bytes() const {
  std::unordered_set<const void*> seen;
  size_t bytes = 0;
  for (const auto& lane : lanes)
    for (const auto& s : lane)
      for (const auto& w : s.writes)
        if (w && seen.insert(w.unsafeGetStorageImpl()).second) bytes += w.nbytes();
  return bytes;
}

void Recording::own_inputs() {
  std::unordered_map<const c10::StorageImpl*, c10::Storage> own;
  for (auto& [v, bytes] : inputs) {
    auto [it, fresh] = own.try_emplace(bytes.unsafeGetStorageImpl());
    if (fresh) it->second = allocate(bytes.nbytes(), bytes.device());
    bytes = it->second;
  }
  auto swap = [&](c10::Storage& s) {
    if (!s) return;
    auto it = own.find(s.unsafeGetStorageImpl());
    if (it != own.end()) s = it->second;
  };
  for (auto& lane : lanes)
    for (auto& step : lane) {
      for (auto& s : step.reads) swap(s);
      for (auto& s : step.writes) swap(s);
    }
  for (auto& [v, bytes] : outputs) swap(bytes);
}

namespace {

// The events of one replay, with whether each has been recorded (on the
// host: a Wait's stream may block on it only once it was).
struct Issued {
  std::vector<std::optional<c10::Event>> events;
  std::vector<char> recorded;
  std::mutex m;
  std::condition_variable cv;
  std::exception_ptr error;
  bool failed = false;
};

// Queues call `step` on the stream of `place` (current): its results, in
// bytes of its own, copied into the bytes it wrote when recorded.
void issue_call(const Recording::Step& step, const Place& place) {
  std::vector<c10::Storage> made = step.call(step.reads, place);
  TORCH_CHECK(made.size() == step.writes.size(), "mgpu: replaying ", step.name, ": ", made.size(),
              " results where the recording has ", step.writes.size());
  for (size_t k = 0; k < made.size(); ++k) {
    const c10::Storage& into = step.writes[k];
    if (!into || !made[k] || made[k].unsafeGetStorageImpl() == into.unsafeGetStorageImpl()) continue;
    const size_t n = std::min(into.nbytes(), made[k].nbytes());
    if (n == 0) continue;
    byte_view(into, n).copy_(byte_view(made[k], n), /*non_blocking=*/true);
    if (place.on_stream() && observers().watches_streams())
      observers().stream_access(place.device, step.name + " (its result into the recorded bytes)", {made[k].data()},
                                {into.data()}, false);
  }
}

// The stream of `place` waits for `event` (recorded, or its Record queued).
void wait_for(const c10::Event& event, const Place& place) {
  observers().before_event_wait();
  if (!observers().drops_event_wait()) event.block(place.stream);
}

// The recording's events by number, each made for the device of the lane
// that records it.
std::vector<std::optional<c10::Event>> events_of(const Recording& r) {
  size_t n = 0;
  for (const auto& lane : r.lanes)
    for (const auto& s : lane)
      if (s.kind != Recording::Step::Kind::Call) n = std::max(n, static_cast<size_t>(s.event) + 1);
  std::vector<std::optional<c10::Event>> events(n);
  for (size_t l = 0; l < r.lanes.size(); ++l)
    for (const auto& s : r.lanes[l])
      if (s.kind == Recording::Step::Kind::Record) events[static_cast<size_t>(s.event)].emplace(r.places.at(l).device.type());
  return events;
}

// Queues `step` on the stream of `place` (current); a Wait's event has
// been recorded (its Record queued): the callers see to that, each its way.
void queue_step(const Recording::Step& step, const Place& place, std::vector<std::optional<c10::Event>>& events) {
  switch (step.kind) {
    case Recording::Step::Kind::Wait:
      wait_for(*events[static_cast<size_t>(step.event)], place);
      break;
    case Recording::Step::Kind::Record:
      events[static_cast<size_t>(step.event)]->record(place.stream);
      break;
    case Recording::Step::Kind::Call:
      issue_call(step, place);
      break;
  }
}

// A lane's steps from a thread of its own: a Wait waits on the host until
// another lane's thread has queued the Record of its event.
void issue_lane(const Recording& r, size_t l, Issued& is) {
  const Place& place = r.places.at(l);
  c10::StreamGuard guard(place.stream);
  for (const auto& step : r.lanes[l]) {
    const auto ev = static_cast<size_t>(step.event);
    if (step.kind == Recording::Step::Kind::Wait) {
      std::unique_lock<std::mutex> lock(is.m);
      is.cv.wait(lock, [&] { return is.failed || is.recorded[ev]; });
      if (is.failed) break;  // another lane failed: this one queues no more, and finishes what it queued
    }
    queue_step(step, place, is.events);
    if (step.kind == Recording::Step::Kind::Record) {
      std::lock_guard<std::mutex> lock(is.m);
      is.recorded[ev] = 1;
      is.cv.notify_all();
    }
  }
  observers().before_stream_sync();
  place.stream.synchronize();
  observers().lane_done();
}

// Queues every lane's steps from this one thread, each on its lane's
// stream, in an order that queues an event's Record before any Wait for it
// (a lane stops at a Wait whose event is not recorded yet, and the next
// lane goes on): no host wait, no stream synchronized. What a CUDA graph's
// capture needs: every call is queued (captured), none has run.
// `issuing`, where given, names the call being queued (a capture's error
// names it).
void issue_in_order(const Recording& r, std::vector<std::optional<c10::Event>>& events,
                    std::string* issuing = nullptr) {
  std::vector<size_t> next(r.lanes.size(), 0);
  std::vector<char> recorded(events.size(), 0);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (size_t l = 0; l < r.lanes.size(); ++l) {
      const auto& lane = r.lanes[l];
      if (next[l] == lane.size()) continue;
      const Place& place = r.places.at(l);
      c10::StreamGuard guard(place.stream);
      for (; next[l] < lane.size(); ++next[l], progressed = true) {
        const Recording::Step& step = lane[next[l]];
        const auto ev = static_cast<size_t>(step.event);
        if (step.kind == Recording::Step::Kind::Wait && !recorded[ev]) break;
        if (issuing) *issuing = step.kind == Recording::Step::Kind::Call ? step.name : std::string();
        queue_step(step, place, events);
        if (step.kind == Recording::Step::Kind::Record) recorded[ev] = 1;
      }
    }
  }
  for (size_t l = 0; l < r.lanes.size(); ++l)
    TORCH_CHECK(next[l] == r.lanes[l].size(), "mgpu: lane ", l, " of a recording waits for an event no lane records");
}

// Tells the stream sanitizer (when it watches) that a replay of `r` is
// done, with the results it left.
void report_run(const Recording& r) {
  if (!observers().watches_streams()) return;
  std::vector<std::pair<const void*, std::string>> results;
  for (const auto& [v, s] : r.outputs)
    if (s) results.emplace_back(s.data(), v.node ? "a replayed result of node " + std::to_string(v.node->id)
                                                 : std::string("a replayed result"));
  observers().run_done(results);
}

} // namespace

void replay_from_one_thread(const Recording& r) {
  TORCH_CHECK(r.unreplayable.empty(), "mgpu: this run cannot be replayed: ", r.unreplayable);
  auto events = events_of(r);
  std::exception_ptr error;
  try {
    issue_in_order(r, events);
  } catch (...) {
    error = std::current_exception();
  }
  // Each busy lane's stream finishes what was queued on it (after an
  // error too: its bytes may be freed once this returns).
  for (size_t l = 0; l < r.lanes.size(); ++l) {
    if (r.lanes[l].empty()) continue;
    observers().before_stream_sync();
    r.places.at(l).stream.synchronize();
    observers().lane_done();
  }
  report_run(r);
  if (error) std::rethrow_exception(error);
}

#ifdef TORCH_MGPU_USE_CUDA
namespace {
// The one device of the recording's busy lanes.
c10::Device device_of(const Recording& r) {
  for (size_t l = 0; l < r.lanes.size(); ++l)
    if (!r.lanes[l].empty()) return r.places.at(l).device;
  return c10::Device(c10::DeviceType::CPU);
}
} // namespace

struct Captured {
  at::cuda::CUDAGraph graph;
  c10::Device device{c10::DeviceType::CUDA, 0};
  size_t steps = 0;
};

namespace {
// Streams only captures use, per device and lane, made on first use and
// never destroyed: a lane's own stream comes from PyTorch's pool, which
// hands the same streams to anyone (another thread's work queued on one
// while it is captured would land in the graph, or end the capture). A
// graph does not depend on the streams it was captured on. One capture at
// a time (capture_mutex) uses them.
std::mutex& capture_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
c10::Stream capture_stream(c10::Device device, size_t k) {
  static auto* streams = new std::map<std::pair<int, size_t>, cudaStream_t>();  // under capture_mutex
  auto& s = (*streams)[{device.index(), k}];
  if (!s) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return c10::cuda::getStreamFromExternal(s, device.index());
}
} // namespace

bool can_capture(const Recording& r) {
  return r.unreplayable.empty() && device_of(r).is_cuda();
}

std::shared_ptr<Captured> capture(const Recording& r, std::string& why_not) {
  TORCH_CHECK(can_capture(r), "mgpu: only a replayable recording on one GPU's streams is captured");
  std::lock_guard<std::mutex> one_at_a_time(capture_mutex());
  auto out = std::make_shared<Captured>();
  out->device = device_of(r);
  c10::cuda::CUDAGuard device_guard(out->device);
  // The recording issued on streams of the capture's own: lane l's on
  // stream l + 1, forked from stream 0 (the capturing one) and joined back
  // into it with events.
  Recording on = r;
  for (size_t l = 0; l < on.places.size(); ++l)
    if (!on.lanes[l].empty()) on.places[l].stream = capture_stream(out->device, l + 1);
  // This run's results, on those streams (which finish it before it
  // returns: the inputs' copies, queued before, are done too), its checks
  // passed (else nothing is captured).
  replay_from_one_thread(on);
  raise_failed_checks(on);
  const c10::cuda::CUDAStream origin(capture_stream(out->device, 0));
  c10::cuda::CUDAStreamGuard stream_guard(origin);
  // Thread-local: other threads may allocate and synchronize meanwhile; the
  // calls of this thread are all queued on the capture's streams. A pool
  // of its own, named here: a failed capture must name it (below).
  const auto pool = at::cuda::graph_pool_handle();
  // Ends the capture (every stream that joined it leaves it), throwing its
  // error.
  auto end_capture = [&] {
    try {
      out->graph.capture_end();
    } catch (...) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 14
      // Before 2.14 a capture_end that fails leaves the allocator routing
      // this capture's allocations to its pool, through a filter that reads
      // the graph this function is about to destroy.
      c10::cuda::CUDACachingAllocator::endAllocateToPool(out->device.index(), pool);
#endif
      throw;
    }
  };
  bool begun = false, ending = false;
  std::string issuing;  // the call being captured
  std::vector<c10::Event> joins;
  try {
    out->graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
    begun = true;
    c10::Event fork(c10::DeviceType::CUDA);
    fork.record(origin);
    for (size_t l = 0; l < on.lanes.size(); ++l)
      if (!on.lanes[l].empty()) fork.block(on.places[l].stream);
    auto events = events_of(on);
    issue_in_order(on, events, &issuing);
    issuing.clear();
    for (size_t l = 0; l < on.lanes.size(); ++l) {
      if (on.lanes[l].empty()) continue;
      joins.emplace_back(c10::DeviceType::CUDA);
      joins.back().record(on.places[l].stream);
      joins.back().block(origin);
    }
    ending = true;
    end_capture();
  } catch (...) {
    if (begun && !ending) {
      try {
        end_capture();  // its error is the first one's consequence
      } catch (...) {
      }
    }
    (void)cudaGetLastError();
    try {
      throw;
    } catch (const std::exception& ex) {
      ir::rethrow_if_interrupt(ex);
      // The error's first line (CUDA's errors go on with advice).
      const std::string message = ir::message_of(ex);
      why_not = (issuing.empty() ? "" : issuing + ": ") + message.substr(0, message.find('\n'));
      return nullptr;
    }
  }
  for (const auto& lane : r.lanes) out->steps += lane.size();
  return out;
}

void launch(const Captured& c) {
  c10::cuda::CUDAGuard device_guard(c.device);
  // CUDAGraph::replay launches on the current stream, which queued the
  // inputs' copies and queues the results' copies after it.
  const_cast<at::cuda::CUDAGraph&>(c.graph).replay();
  c10::cuda::getCurrentCUDAStream(c.device.index()).synchronize();
}
#else
struct Captured {};

bool can_capture(const Recording&) { return false; }

std::shared_ptr<Captured> capture(const Recording&, std::string&) {
  TORCH_CHECK(false, "mgpu: this build captures no CUDA graph (built without CUDA)");
}

void launch(const Captured&) {
  TORCH_CHECK(false, "mgpu: this build captures no CUDA graph (built without CUDA)");
}
#endif

void replay(const Recording& r) {
  TORCH_CHECK(r.unreplayable.empty(), "mgpu: this run cannot be replayed: ", r.unreplayable);
  Issued is;
  is.events = events_of(r);
  is.recorded.assign(is.events.size(), 0);
  std::vector<size_t> busy;
  for (size_t l = 0; l < r.lanes.size(); ++l)
    if (!r.lanes[l].empty()) busy.push_back(l);
  at::ThreadLocalState tls;
  std::vector<std::function<void()>> jobs;
  for (size_t l : busy)
    jobs.emplace_back([&r, &is, &tls, l] {
      at::ThreadLocalStateGuard state(tls);
      try {
        issue_lane(r, l, is);
      } catch (...) {
        // The other lanes stop at their next wait; their streams finish
        // what they queued.
        std::lock_guard<std::mutex> lock(is.m);
        if (!is.error) is.error = std::current_exception();
        is.failed = true;
        is.cv.notify_all();
        try {
          r.places.at(l).stream.synchronize();
          observers().lane_done();  // its bytes may be freed once the replay returns
        } catch (...) {
        }
      }
    });
  if (jobs.size() == 1) {
    jobs[0]();
  } else if (!jobs.empty()) {
    LanePool::instance().run(jobs, r.threads_per_lane);
  }
  report_run(r);
  if (is.error) std::rethrow_exception(is.error);
}

} // namespace torch_mgpu::runtime
