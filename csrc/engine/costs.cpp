// The torch.compile partitioner's questions (torch_mgpu/_partition.py),
// answered by the model that plans the lanes configured now: what a piece
// of work costs on one lane, and how long pieces take list-scheduled over
// the lanes as partitions.
#include "engine/engine.h"
#include "engine/execution.h"
#include "plan/groups.h"

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
  const auto t = topology_for(lanes);
  const auto& cm = cost_model();
  for (double& s : seconds) s += cm.partition_call_s;
  return plan::schedule_tasks(t, cm, plan::make_tasks(std::move(seconds), preds)).makespan;
}

std::vector<std::vector<int>> schedule_groups(const std::vector<double>& cost,
                                              const std::vector<std::vector<int>>& preds, int lanes,
                                              std::vector<int>& lane_of, double& makespan, bool siblings) {
  const size_t n = cost.size();
  double total = 0;
  for (double c : cost) total += c;
  const auto cm = cost_model();
  std::vector<int> all(n);
  for (size_t k = 0; k < n; ++k) all[k] = static_cast<int>(k);
  lane_of.assign(1, 0);
  makespan = total + cm.partition_call_s;
  if (lanes < 2 || n < 2) return {all};
  // Small: not worth a piece's call, or a sliver of the whole graph.
  auto groups = plan::group_nodes(cost, preds, std::max(cm.partition_call_s, total / (16.0 * lanes)), siblings);
  if (groups.size() < 2) return {all};
  PricedPieces priced = price_pieces(groups, cost, preds);
  for (double& s : priced.seconds) s += cm.partition_call_s;
  const auto sched =
      plan::schedule_tasks(topology_for(lanes), cm, plan::make_tasks(std::move(priced.seconds), priced.preds));
  lane_of = sched.lane_of;
  makespan = sched.makespan;
  return groups;
}

std::vector<std::vector<int>> split_groups(const std::vector<double>& cost, const std::vector<std::vector<int>>& preds,
                                           int lanes) {
  std::vector<int> lane_of;
  double makespan = 0;
  auto groups = schedule_groups(cost, preds, lanes, lane_of, makespan, false);
  double total = 0;
  for (double c : cost) total += c;
  if (groups.size() > 1 && worth_splitting(makespan, total)) return groups;
  std::vector<int> all(cost.size());
  for (size_t k = 0; k < cost.size(); ++k) all[k] = static_cast<int>(k);
  return {all};
}

PricedPieces price_pieces(const std::vector<std::vector<int>>& pieces, const std::vector<double>& cost,
                          const std::vector<std::vector<int>>& preds) {
  PricedPieces out;
  out.piece_of.assign(cost.size(), -1);
  for (size_t k = 0; k < pieces.size(); ++k)
    for (int i : pieces[k]) out.piece_of[static_cast<size_t>(i)] = static_cast<int>(k);
  out.seconds.assign(pieces.size(), 0.0);
  out.preds.assign(pieces.size(), {});
  for (size_t k = 0; k < pieces.size(); ++k)
    for (int i : pieces[k]) {
      out.seconds[k] += cost[static_cast<size_t>(i)];
      for (int p : preds[static_cast<size_t>(i)]) {
        const int d = out.piece_of[static_cast<size_t>(p)];
        auto& pp = out.preds[k];
        if (d >= 0 && d != static_cast<int>(k) && std::find(pp.begin(), pp.end(), d) == pp.end()) pp.push_back(d);
      }
    }
  return out;
}

bool worth_splitting(double makespan, double total) {
  return makespan * plan::kMinSplitGain <= total + cost_model().partition_call_s;
}

} // namespace torch_mgpu::engine
