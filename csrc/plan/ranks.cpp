// A plan's nodes placed for lanes on other ranks (ranks.h).
#include "plan/ranks.h"

#include <algorithm>

namespace torch_mgpu::plan {

namespace {
// Every lane runs its nodes by their predicted start (a node starts after
// what it reads ends, so the lanes' orders agree with the graph's), after
// nodes moved between lanes; then the lanes used and their threads, fusion
// groups, transfers and the predicted timeline follow the new lanes.
void reorder_lanes(const ir::Graph& g, const Topology& topo, const CostModel& cm,
                   const std::vector<double>& scale, Plan& p) {
  for (auto& order : p.lane_order) order.clear();
  std::vector<int> all(g.size());
  for (size_t i = 0; i < g.size(); ++i) all[i] = static_cast<int>(i);
  std::stable_sort(all.begin(), all.end(), [&](int a, int b) {
    return std::make_pair(p.predicted_start[a], a) < std::make_pair(p.predicted_start[b], b);
  });
  for (int i : all) p.lane_order[p.lane_of[i]].push_back(i);
  p.transfers = 0;
  for (size_t i = 0; i < g.size(); ++i)
    for (int d : g.deps[i])
      if (topo.lanes[p.lane_of[d]].device != topo.lanes[p.lane_of[i]].device) p.transfers++;
  std::vector<Work> work(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    work[i] = estimate_work(*g.nodes[i]);
    if (i < scale.size()) work[i].scale = scale[i];
  }
  set_lane_use(g, topo, cm, work, p);  // moves may have emptied a lane
  if (!p.fusion.groups.empty()) apply_fusion(g, topo, cm, work, p);
  else simulate(g, topo, cm, work, p);
}

// Nodes a worker cannot be sent (a constant that is not plain data, such as
// a custom class) move to this process's first lane.
bool keep_unsendable_here(const ir::Graph& g, const Topology& topo, Plan& p, const CanSend& can_send) {
  int here = -1;
  for (size_t l = 0; l < topo.lanes.size() && here < 0; ++l)
    if (topo.lanes[l].rank == 0) here = static_cast<int>(l);
  if (here < 0) return false;  // no lane here: the node fails on its worker lane, naming its constant
  bool moved = false;
  for (size_t i = 0; i < g.size(); ++i)
    if (topo.lanes[p.lane_of[i]].rank != 0 && !can_send(*g.nodes[i])) {
      p.lane_of[i] = here;
      moved = true;
    }
  return moved;
}

// A short node that reads only materialized values (kept on every rank) or
// values of one lane, whose every reader is on that lane, and that runs on
// another rank, moves to that lane: its result then never crosses ranks,
// where a crossing costs more than the node (the plan keeps the moves when
// the model predicts it no slower for them). (List scheduling places such
// preparation, ready at once, on whichever lane is free first, before it
// sees where its readers go.) Readers before producers, so that a chain of
// them moves whole.
bool pull_to_readers(const ir::Graph& g, const Topology& topo, const CostModel& cm, Plan& p, const CanSend& can_send) {
  const size_t n = g.size();
  // Readers first: where each node would go (-1: stays).
  std::vector<int> to(n, -1);
  auto lane = [&](int i) { return to[i] >= 0 ? to[i] : p.lane_of[i]; };
  for (size_t k = n; k-- > 0;) {
    const int i = static_cast<int>(k);
    if (g.users[i].empty()) continue;
    const int t = lane(g.users[i][0]);
    if (topo.lanes[t].rank == topo.lanes[p.lane_of[i]].rank) continue;
    bool ok = p.predicted_end[i] - p.predicted_start[i] < cm.network_latency_s &&
        (topo.lanes[t].rank == 0 || can_send(*g.nodes[i]));
    for (int u : g.users[i]) ok &= lane(u) == t;
    if (ok) to[i] = t;
  }
  // Then producers first: a node moves only if what it reads is there too
  // (a materialized value is everywhere).
  bool moved = false;
  for (size_t i = 0; i < n; ++i) {
    if (to[i] < 0) continue;
    bool ok = true;
    for (int d : g.deps[i]) ok &= p.lane_of[d] == to[i];
    if (!ok) continue;
    p.lane_of[i] = to[i];
    moved = true;
  }
  return moved;
}
} // namespace

void place_for_ranks(const ir::Graph& g, const Topology& topo, const CostModel& cm, const std::vector<double>& scale,
                     Plan& p, const CanSend& can_send) {
  if (keep_unsendable_here(g, topo, p, can_send)) reorder_lanes(g, topo, cm, scale, p);
  // Kept where the model predicts it no slower.
  Plan pulled = p;
  if (pull_to_readers(g, topo, cm, pulled, can_send)) {
    reorder_lanes(g, topo, cm, scale, pulled);
    if (pulled.predicted_makespan <= p.predicted_makespan) p = std::move(pulled);
  }
}

} // namespace torch_mgpu::plan
