#pragma once
// The engine joins the stages at a sync point:
// collect -> post-order graph -> hash -> plan (cached) -> execute -> bind.
#include "ir/graph.h"
#include "plan/plan.h"
#include "runtime/executor.h"

#include <memory>

namespace torch_mgpu::engine {

// What the last sync ran, for torch_mgpu.last_plan().
struct PlanRecord {
  std::string text;          // the graph listing
  std::string dot;           // graphviz with lanes
  std::vector<std::string> node_names;
  std::vector<std::string> lane_names;
  std::vector<runtime::NodeTiming> timing;
  std::vector<int> lane_of;
  std::string policy;
  double predicted_makespan = 0;
  double measured_makespan = 0;
  uint64_t graph_hash = 0;
};

std::shared_ptr<const PlanRecord> last_plan();

} // namespace torch_mgpu::engine
