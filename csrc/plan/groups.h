#pragma once
// Groups of a graph's nodes worth running as separately compiled pieces on
// the lanes: the split that torch.compile's partitioner (torch_mgpu/
// _partition.py) and tier 1 of the lazy path (engine/tiers.h) make.
//
// 1. every node is a group;
// 2. chains are contracted: a group whose only successor has it as its only
//    predecessor is merged with that successor (nothing can overlap them);
// 3. groups cheaper than `small` seconds are merged: with `siblings`, into
//    the cheapest small sibling (same predecessors and successors) first;
//    else into a neighbour: their only predecessor (the work stays in the
//    parallel part), else their only successor, else the cheapest successor
//    whose merge keeps the graph acyclic (an island with no neighbour: the
//    cheapest group), contracting chains after each merge;
// 4. chains are contracted again.
// Whether the groups are worth their calls is the caller's to decide (list
// schedule them: plan.h's schedule_tasks).
#include <vector>

namespace torch_mgpu::plan {

// How much faster than one piece the groups, list-scheduled over the lanes
// each paying a call, must be predicted to run before a graph is split.
constexpr double kMinSplitGain = 1.15;

// `cost[k]`: seconds of node k; `preds[k]`: the nodes it reads (earlier
// ones: k's index is a topological order). Returns the groups in a
// topological order (by their first member), each its nodes ascending.
// `siblings`: bundle small siblings (tier 1, which compiles in the
// background, splits 64 small feature transforms into bundles; the
// torch.compile backend, which compiles before the first call returns,
// keeps them with their join).
std::vector<std::vector<int>> group_nodes(const std::vector<double>& cost, const std::vector<std::vector<int>>& preds,
                                          double small, bool siblings = false);

} // namespace torch_mgpu::plan
