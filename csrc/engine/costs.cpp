// The torch.compile partitioner's questions (torch_mgpu/_partition.py),
// answered by the model that plans the lanes configured now: what a piece
// of work costs on one lane, and how long pieces take list-scheduled over
// the lanes as partitions.
#include "engine/engine.h"
#include "engine/execution.h"

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
  const auto t = topology_for(lanes);
  const auto& cm = cost_model();
  for (double& s : seconds) s += cm.partition_call_s;
  return plan::schedule_tasks(t, cm, plan::make_tasks(std::move(seconds), preds)).makespan;
}

} // namespace torch_mgpu::engine
