// Events on mgpu (torch.Event("mgpu"), torch.mgpu.Event). Work on mgpu is
// ordered by its data, not by streams, so an event marks a point in the
// recorded program: it is complete once every op recorded before it has run,
// on whatever lane, and its time is when the last of them ended (or when it
// was recorded, if they had all run by then). elapsed_time between two
// events is therefore measured lane time.
#include "capture/capture.h"
#include "ir/fork_order.h"
#include "capture/state_lock.h"
#include "engine/events.h"
#include "engine/at_call.h"
#include "engine/execution.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_set>

namespace torch_mgpu::engine {
namespace {

double seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// Events recorded and not yet known complete: executions report to them.
struct Registry {
  std::mutex m;
  std::unordered_set<Event*> waiting;
  std::atomic<size_t> size{0};
};
Registry& registry() {
  static auto* r = [] {
    auto* reg = new Registry();  // leaked: events may die during exit
    // A fork while another thread holds the mutex would leave it locked in
    // the child.
    ir::on_fork(ir::ForkRank::Registry, [] { registry().m.lock(); }, [] { registry().m.unlock(); }, [] { registry().m.unlock(); });
    return reg;
  }();
  return *r;
}

void set_waiting(Event* e, bool waiting) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  if (waiting) r.waiting.insert(e);
  else r.waiting.erase(e);
  r.size.store(r.waiting.size());
}

// The smallest id of a pending op that a live tensor still needs, or
// UINT64_MAX. Under the state lock, with no flight running.
uint64_t oldest_pending_op() {
  uint64_t oldest = UINT64_MAX;
  std::vector<const ir::Node*> stack;
  std::unordered_set<const ir::Node*> seen;
  for (const auto& v : pending_roots())
    if (seen.insert(v.node.get()).second) stack.push_back(v.node.get());
  while (!stack.empty()) {
    const ir::Node* n = stack.back();
    stack.pop_back();
    oldest = std::min(oldest, n->id);
    for (const auto& v : n->operands)
      if (v.node && v.node->is_pending() && seen.insert(v.node.get()).second) stack.push_back(v.node.get());
  }
  return oldest;
}

} // namespace

Event::~Event() {
  if (!complete_) set_waiting(this, false);
}

void Event::record() {
  capture::StateLock lock;
  horizon_ = ir::next_node_id();
  recorded_ = seconds(std::chrono::steady_clock::now());
  done_at_ = recorded_;
  complete_ = ir::pending_op_count() == 0;
  set_waiting(this, !complete_);
  ever_recorded_ = true;
}

bool Event::done() {
  if (!ever_recorded_ || complete_) return true;  // never recorded: nothing to wait for, as on CUDA
  if (flight_running()) return false;
  if (ir::pending_op_count() == 0 || oldest_pending_op() >= horizon_) {
    complete_ = true;
    set_waiting(this, false);
  }
  return complete_;
}

namespace {
// Pending work that nothing runs yet: starts it in the background, as a GPU
// would already be running it, so that polling makes progress; where it
// cannot run in the background, runs it here. True when it ran here.
bool run_pending_here() {
  if (start_flight()) return false;
  sync_all();
  return true;
}
} // namespace

bool Event::query() {
  capture::StateLock lock;
  if (done()) return true;
  return run_pending_here() && done();
}

void Event::synchronize() {
  at_call::ProgramRead read;
  capture::StateLock lock;
  if (done()) return;
  sync_all();  // runs what the event waits for (and what came after): raises its errors
  TORCH_INTERNAL_ASSERT(done(), "mgpu: an event is still pending after a sync");
}

double Event::elapsed_ms(Event& end) {
  capture::StateLock lock;
  TORCH_CHECK(ever_recorded_ && end.ever_recorded_, "Both events must be recorded before calculating elapsed time.");
  TORCH_CHECK(timing_ && end.timing_, "Both events must be created with argument 'enable_timing=True'.");
  TORCH_CHECK(done() && end.done(),
              "mgpu error: device not ready: an event's work has not run yet (call synchronize() on it first)");
  return (end.done_at_ - done_at_) * 1000.0;
}

bool stream_idle() {
  if (ir::pending_op_count() == 0) return true;
  capture::StateLock lock;
  if (flight_running()) return false;
  if (ir::pending_op_count() == 0) return true;
  return run_pending_here() && ir::pending_op_count() == 0;
}

void observe_executed(const ir::Graph& g, const runtime::ExecResult& r) {
  auto& reg = registry();
  if (reg.size.load() == 0) return;
  // (id, end) of every node that ran, by id; with the running maximum of
  // the end times, an event's time is one binary search away.
  std::vector<std::pair<uint64_t, double>> ends;
  const double start = seconds(r.started);
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (r.status[i] == runtime::Status::Ok || r.status[i] == runtime::Status::Failed)
      ends.emplace_back(g.nodes[i]->id, start + r.timing[i].end);
  if (ends.empty()) return;
  std::sort(ends.begin(), ends.end());
  for (size_t i = 1; i < ends.size(); ++i) ends[i].second = std::max(ends[i].second, ends[i - 1].second);
  std::lock_guard<std::mutex> lock(reg.m);
  for (Event* e : reg.waiting) {
    auto it = std::lower_bound(ends.begin(), ends.end(), std::make_pair(e->horizon_, -1.0));
    if (it == ends.begin()) continue;
    e->done_at_ = std::max(e->done_at_, std::prev(it)->second);
  }
}

} // namespace torch_mgpu::engine
