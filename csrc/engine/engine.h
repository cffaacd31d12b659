#pragma once
// The engine joins the stages at a sync point:
// collect -> post-order graph -> hash -> plan (cached) -> execute -> bind.
#include "ir/graph.h"
#include "plan/plan.h"
#include "runtime/executor.h"

#include <torch_mgpu/mgpu.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch_mgpu::engine {

// What a plan ran (or would run), for last_plan() and simulate().
struct PlanRecord {
  ir::GraphSummary graph;    // names and edges: text and dot are made on demand
  std::vector<std::string> lane_names;
  std::vector<int> lane_of;
  std::vector<runtime::NodeTiming> timing;  // measured (empty when simulated)
  std::vector<double> predicted_start, predicted_end;
  std::vector<int> fused;                   // per node: its pointwise group, -1 (empty when simulated)
  std::string policy;
  int lanes_used = 1;
  int transfers = 0;
  int64_t remote_bytes_sent = 0, remote_bytes_received = 0;  // values to and from other ranks
  int64_t remote_bytes_between_workers = 0;                   // values one worker rank sent another
  double predicted_makespan = 0;
  double measured_makespan = 0;
  bool refined = false;  // planned with measured node times (plan::Plan::refined)
  uint64_t graph_hash = 0;
  // 1: the graph ran as compiled code (engine/tiers.h), not node by node;
  // 2: it replayed a recording of an earlier run (engine/replays.h).
  int tier = 0;
  std::string compiled;   // tier 1: what the compiled code is
  std::string replay;     // whether it was recorded or replayed, or why it is not replayed ("" when not hot)
};

std::shared_ptr<const PlanRecord> last_plan();
// Per node: op, lane, measured and predicted times (the public TimelineEntry).
std::vector<TimelineEntry> timeline_of(const PlanRecord& rec);

// Lanes and policy. Empty / non-positive arguments keep the current value.
void configure(const std::vector<std::string>& devices, int lanes_per_device, const std::string& policy);
// Starts the stream sanitizer (runtime/sanitizer.h): the lanes are remade,
// CPU lanes as stream lanes whose every access is checked.
void start_stream_sanitizer();
// Runs what is pending, stops the sanitizer and remakes the lanes as host
// lanes; returns the races it saw.
std::vector<std::string> stop_stream_sanitizer();
std::vector<std::string> lane_names();
std::string policy();
// The cost model plans follow: the pinned one where one is, else the
// calibrated one (measured at first use, then cached).
plan::CostModel cost_model();
// Pins the model every plan follows from now on (nullopt: the calibrated one
// again), with no refinement by measured times while pinned: plans that do
// not move with the machine's load, for tests that assert a plan's shape.
// Runs what is pending first and empties the plan cache.
void pin_cost_model(std::optional<plan::CostModel> cm);
bool cost_model_pinned();

// torch.compile's partitioner asks the model that plans (engine/costs.cpp):
// seconds of `w` on one of `lanes` lanes like the current ones when all of
// them run; and the makespan of pieces of work (seconds each, predecessors
// earlier pieces) run as compiled partitions, list-scheduled over them.
double work_seconds(const plan::Work& w, int lanes);
double partition_makespan(std::vector<double> seconds, const std::vector<std::vector<int>>& preds, int lanes);
// plan::schedule_groups' groups on lanes like the current ones (small
// siblings not bundled: see plan/groups.h) where worth splitting, else one
// group of every node (torch.compile's partitioner).
std::vector<std::vector<int>> split_groups(const std::vector<double>& cost, const std::vector<std::vector<int>>& preds,
                                           int lanes);

struct Simulation {
  double makespan = 0, lower_bound = 0, critical_path = 0, total_work = 0;
  std::shared_ptr<const PlanRecord> plan;
};
// Plans the pending graph for K virtual devices with S lanes each, runs
// nothing. `device`: a GPU profile's name (plan/topology.h: "h100", ...)
// for K such GPUs with S streams each; empty: devices like the current ones.
// `hosts` > 1: that many processes, this one with the devices above and
// each other one a worker rank with one lane (lanes on other ranks).
Simulation simulate(int devices, int lanes_per_device, const std::string& policy, const std::string& device = "",
                    int hosts = 1);

// Why the pending graph, planned as a sync from this thread would plan it
// on the current lanes, could not be captured and replayed
// (runtime/replay.h); nullopt where it could. Runs nothing.
std::optional<std::string> replay_blocker_of_pending();

// Computes every pending value (the sync point). Raises the first error an
// op raised during execution, after binding everything that did compute.
void sync_all();
// The materialized CPU bytes of an mgpu storage (syncs if pending).
c10::Storage materialize(const c10::Storage& mgpu_storage);

// Background execution: once `async_ops()` ops have been recorded since the
// last flush, the pending graph starts running on a background worker while
// capture goes on (0: never). Called after each recorded op. A flight
// runs under the program's settings as they are when it starts (setters
// wait for it; a sync puts a graph's own in place instead): it starts only
// while they are still those the pending ops were called with (an
// elementwise op does not read the matmul precision, so one recorded after
// the program changed it leaves the pending ops pending).
void recorded(bool background_safe);
int64_t async_ops();
void set_async_ops(int64_t n);
// Waits for the flight in progress, if any, and binds it (an error it raised
// surfaces at the next sync, as always). Called before a process-wide
// setting changes (the default dtype, deterministic mode, matmul precision):
// a flight's kernels read those settings while they run, so a change made
// under a running flight would reach ops called before it.
void wait_for_flight();

// The graph-size limit that triggers an automatic sync.
int64_t max_pending_ops();
void set_max_pending_ops(int64_t n);

} // namespace torch_mgpu::engine
