// The torch.compile partitioner's questions (torch_mgpu/_partition.py),
// answered by the model that plans the lanes configured now: what a piece
// of work costs on one lane, how long pieces take list-scheduled over the
// lanes as partitions, and the groups worth splitting (plan/pieces.h).
#include "engine/engine.h"
#include "engine/execution.h"
#include "plan/pieces.h"

#include <algorithm>

namespace torch_mgpu::engine {

namespace {
plan::Topology topology_for(int lanes) {
  auto now = current_lanes();
  TORCH_CHECK(lanes >= 1, "torch_mgpu: lanes must be >= 1, got ", lanes);
  if (static_cast<size_t>(lanes) == now->topo.lanes.size()) return now->topo;
  return plan::make_topology({now->topo.devices.at(0)}, lanes, now->topo.cores);
}
} // namespace

double work_seconds(const plan::Work& w, int lanes) {
  const auto t = topology_for(lanes);
  return plan::node_seconds(w, cost_model(), t.threads_per_lane(lanes));
}

double partition_makespan(std::vector<double> seconds, const std::vector<std::vector<int>>& preds, int lanes) {
  return plan::pieces_makespan(topology_for(lanes), cost_model(), std::move(seconds), preds);
}

std::vector<std::vector<int>> split_groups(const std::vector<double>& cost, const std::vector<std::vector<int>>& preds,
                                           int lanes) {
  const auto cm = cost_model();
  plan::ScheduledGroups sched = plan::schedule_groups(topology_for(lanes), cm, cost, preds, /*siblings=*/false);
  double total = 0;
  for (double c : cost) total += c;
  if (sched.groups.size() > 1 && plan::worth_splitting(sched.makespan, total, cm)) return sched.groups;
  std::vector<int> all(cost.size());
  for (size_t k = 0; k < cost.size(); ++k) all[k] = static_cast<int>(k);
  return {all};
}

} // namespace torch_mgpu::engine
