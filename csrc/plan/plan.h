#pragma once
// A Plan says which lane runs each node and in what order, which in-place
// writes may reuse their input's bytes, and what the cost model predicts.
// Policies: "serial" (one lane, the reference), "heft" (the textbook list
// scheduler), "auto" (chain clustering + list scheduling, kept only where
// it is predicted to beat one lane; never worse than heft by prediction).
#include "ir/graph.h"
#include "plan/fusion.h"
#include "plan/cost_model.h"

#include <string>
#include <vector>

namespace torch_mgpu::plan {

struct Plan {
  std::string policy = "serial";
  std::vector<Lane> lanes;                    // the topology's lanes
  std::vector<int> lane_of;                   // per node
  std::vector<std::vector<int>> lane_order;   // per lane: nodes in run order
  // reuse[i][k]: node i may write operand k in place (it is that value's
  // only reader), instead of writing a copy.
  std::vector<std::vector<bool>> reuse;
  // Runs of elementwise ops on a lane that execute as one pass (filled
  // by the sync for the plans it runs; empty: every node runs alone).
  Fusion fusion;
  int lanes_used = 1;
  int threads_per_lane = 1;
  // One-lane plans: one_thread[i] runs node i on one thread (empty: none).
  std::vector<char> one_thread;
  int transfers = 0;                          // edges that cross devices
  // Predictions (seconds from the start of execution).
  std::vector<double> predicted_start, predicted_end;
  double predicted_makespan = 0.0;
  // Made with measured per-node scales (Work::scale) from earlier runs.
  bool refined = false;
};

// Estimates for a graph on a topology.
struct Estimate {
  std::vector<Work> work;           // per node
  double critical_path = 0;         // longest path, one lane per node, no transfers
  double total_work = 0;            // sum over nodes, one thread each
  double lower_bound = 0;           // max(critical path, total work / lanes)
};
// `scale`: per node, Work::scale (empty: all 1).
Estimate estimate(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<double>& scale = {});

// The bounds of `e` (critical path, total work, lower bound on `lanes`
// lanes) from the plan's own predicted node times instead of the model's
// (fused runs and measured corrections change what a node costs).
void bounds_from_plan(const ir::Graph& g, const Plan& p, int lanes, Estimate& e);

// `fuse`: the plan will run on CPU lanes with pointwise fusion; each
// candidate is fused (apply_fusion) before the predictions are compared.
// `scale`: per node, measured over modelled time from earlier runs of the
// same graph (Work::scale; empty: the model alone).
Plan make_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::string& policy,
               bool fuse = false, const std::vector<double>& scale = {});
Plan make_serial_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, bool fuse = false,
                      const std::vector<double>& scale = {});
Plan make_heft_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, bool fuse = false,
                    const std::vector<double>& scale = {});
Plan make_auto_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, bool fuse = false,
                    const std::vector<double>& scale = {});

// Work in pieces for the list scheduler: a task is one node, a chain of
// them, or (for torch.compile's partitioner) a group of another graph's ops.
struct Tasks {
  std::vector<std::vector<int>> members;        // nodes of each task, in order
  std::vector<int> task_of;                     // per node
  std::vector<double> cost;                     // per task, seconds on one lane
  std::vector<std::vector<int>> preds, succs;   // task edges
  std::vector<double> out_bytes;                // bytes a task hands to a successor
  std::vector<double> fill;                     // per task: the share of a GPU it fills (cost-weighted)
};
// Tasks k = 0..n-1 of one member each, with these costs (seconds) and
// predecessors (each an earlier task), handing `out_bytes` (empty: none)
// to their successors; they fill the device (1).
Tasks make_tasks(std::vector<double> cost, const std::vector<std::vector<int>>& preds,
                 std::vector<double> out_bytes = {});

struct TaskSchedule {
  std::vector<int> order;      // tasks in the order they were placed
  std::vector<int> lane_of;    // per task: index into the topology's lanes
  std::vector<double> finish;  // per task: predicted end (seconds)
  double makespan = 0;
};
// The list schedule every parallel plan is made with (HEFT: the task of
// highest upward rank first, each on the lane where it ends first, paying
// edge_seconds between lanes and, on a GPU, the device's shared SMs).
TaskSchedule schedule_tasks(const Topology& t, const CostModel& cm, const Tasks& ts);

// Predicts the plan's timeline with the cost model (event simulation: a
// node starts when its lane is free and its inputs have arrived); fills the
// plan's predicted_* fields.
void simulate(const ir::Graph& g, const Topology& t, const CostModel& cm, Plan& plan);
void simulate(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work, Plan& plan);

// Fuses runs of elementwise ops along the plan's lanes (plan/fusion.h) and
// predicts the timeline again: a fused step after a group's first costs its
// arithmetic only. `work`: estimate_work of each node.
void apply_fusion(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work,
                  Plan& plan);

// Lanes used, the threads each runs with and the products of a one-lane
// plan too small for threads (one_thread), from the plan's lane_order:
// after nodes moved between lanes. `work`: estimate_work of each node.
void set_lane_use(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work,
                  Plan& plan);

// Fills `reuse`: a write may reuse its input bytes only when the writer is
// that version's only reader and the version is not wanted after the sync.
void compute_reuse(const ir::Graph& g, Plan& plan);

} // namespace torch_mgpu::plan
