#pragma once
// One execution of the pending graph, shared by the foreground sync
// (sync.cpp) and background flights (background.cpp). Internal.
#include "ir/trial.h"
#include "engine/engine.h"
#include "runtime/lanes.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <vector>

namespace torch_mgpu::engine {

using clock = std::chrono::steady_clock;
inline int64_t micros(clock::time_point a, clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::microseconds>(b - a).count();
}
// The median of measured times (the upper one of an even count; `v` not empty).
using ir::median;

// Where graphs run: the lanes' topology, their places and the policy.
// Never changed once made: configure() makes a new one.
struct Lanes {
  plan::Topology topo;
  std::vector<runtime::Place> places;
  std::string policy;
};
// The lanes configured now.
std::shared_ptr<const Lanes> current_lanes();

// One execution of a graph: built, planned and run either by the sync
// itself (a foreground sync) or by the background worker (a flight). Both
// run compiled code where a graph has it (engine/tiers.h); compiled code
// takes the GIL, so whoever waits for a flight lets go of the GIL first
// (finish_flight).
struct Execution {
  std::shared_ptr<const Lanes> lanes = current_lanes();  // as configured when it was made
  std::vector<ir::Value> roots;  // the live pending values when it started
  // The intra-op threads of the thread that made it (a flight runs on
  // another): a one-lane plan runs with these.
  int caller_threads = runtime::thread_parallelism();
  ir::Graph g;
  std::shared_ptr<const plan::Plan> plan;
  runtime::ExecResult result;
  std::shared_ptr<const PlanRecord> record;  // for last_plan()
  bool ran = false;  // execution began: the results must be bound

  void run();  // build, plan (cached), execute, describe
};

// Binds an execution's results (see sync.cpp). Under the state lock, with
// nothing running.
void bind(Execution& e);
// The live pending values, in creation order (a program builds the same
// graph every time).
std::vector<ir::Value> pending_roots();

// Background execution (background.cpp), under the state lock.
// Waits for the running flight, if any, and binds it.
void finish_flight();
// Whether a flight is still running; one that has finished is bound first.
bool flight_running();
// Starts the pending graph as a background flight (when none runs). False
// where it cannot run in the background (background execution off, a
// pending op that must run in the foreground, a forked child, a profiler).
bool start_flight();
// After a sync ran everything pending: restarts the flush count and returns
// the first error of a flight bound since the last sync (once).
std::exception_ptr take_background_error();

// Events (events.cpp): the ops an execution ran, with their end times, for
// the events recorded after them. Under the state lock, from bind().
void observe_executed(const ir::Graph& g, const runtime::ExecResult& r);

} // namespace torch_mgpu::engine
