#include "runtime/replay.h"

#include "runtime/lanes.h"
#include "runtime/observer.h"
#include "runtime/run_node.h"

#include <ATen/ThreadLocalState.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

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

// The bytes of `s` as a flat tensor of bytes, on the storage's device.
at::Tensor bytes_of(const c10::Storage& s, size_t n) {
  ir::TensorGeometry flat;
  flat.dtype = c10::ScalarType::Byte;
  flat.sizes = {static_cast<int64_t>(n)};
  flat.strides = {1};
  return view(s, flat);
}

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

void issue_lane(const Recording& r, size_t l, Issued& is) {
  const Place& place = r.places.at(l);
  c10::StreamGuard guard(place.stream);
  bool stopped = false;  // another lane failed: this one queues no more, and finishes what it queued
  for (const auto& step : r.lanes[l]) {
    if (stopped) break;
    switch (step.kind) {
      case Recording::Step::Kind::Wait: {
        {
          std::unique_lock<std::mutex> lock(is.m);
          is.cv.wait(lock, [&] { return is.failed || is.recorded[static_cast<size_t>(step.event)]; });
          stopped = is.failed;
        }
        if (stopped) break;
        observers().before_event_wait();
        if (!observers().drops_event_wait()) is.events[static_cast<size_t>(step.event)]->block(place.stream);
        break;
      }
      case Recording::Step::Kind::Record: {
        is.events[static_cast<size_t>(step.event)]->record(place.stream);
        std::lock_guard<std::mutex> lock(is.m);
        is.recorded[static_cast<size_t>(step.event)] = 1;
        is.cv.notify_all();
        break;
      }
      case Recording::Step::Kind::Call: {
        std::vector<c10::Storage> made = step.call(step.reads, place);
        TORCH_CHECK(made.size() == step.writes.size(), "mgpu: replaying ", step.name, ": ", made.size(),
                    " results where the recording has ", step.writes.size());
        for (size_t k = 0; k < made.size(); ++k) {
          const c10::Storage& into = step.writes[k];
          if (!into || !made[k] || made[k].unsafeGetStorageImpl() == into.unsafeGetStorageImpl()) continue;
          const size_t n = std::min(into.nbytes(), made[k].nbytes());
          if (n == 0) continue;
          bytes_of(into, n).copy_(bytes_of(made[k], n), /*non_blocking=*/true);
          if (place.on_stream() && observers().watches_streams())
            observers().stream_access(place.device, step.name + " (its result into the recorded bytes)", {made[k].data()},
                                      {into.data()}, false);
        }
        break;
      }
    }
  }
  observers().before_stream_sync();
  place.stream.synchronize();
  observers().lane_done();
}

} // namespace

void replay(const Recording& r) {
  TORCH_CHECK(r.unreplayable.empty(), "mgpu: this run cannot be replayed: ", r.unreplayable);
  Issued is;
  size_t events = 0;
  for (const auto& lane : r.lanes)
    for (const auto& s : lane)
      if (s.kind != Recording::Step::Kind::Call) events = std::max(events, static_cast<size_t>(s.event) + 1);
  is.events.resize(events);
  is.recorded.assign(events, 0);
  for (size_t l = 0; l < r.lanes.size(); ++l)
    for (const auto& s : r.lanes[l])
      if (s.kind == Recording::Step::Kind::Record)
        is.events[static_cast<size_t>(s.event)].emplace(r.places.at(l).device.type());
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
  if (observers().watches_streams()) {
    std::vector<std::pair<const void*, std::string>> results;
    for (const auto& [v, s] : r.outputs)
      if (s) results.emplace_back(s.data(), v.node ? "a replayed result of node " + std::to_string(v.node->id)
                                                   : std::string("a replayed result"));
    observers().run_done(results);
  }
  if (is.error) std::rethrow_exception(is.error);
}

} // namespace torch_mgpu::runtime
