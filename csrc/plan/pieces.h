#pragma once
// Pieces of a graph run as separately compiled calls on the lanes (tier
// 1's parts, torch.compile's partitions): their prices, their schedule
// over the lanes, whether they beat one piece, and a lane's groups joined
// into parts. Pure functions of node costs and edges: the engine asks them
// with the cost model and lanes configured now (engine/costs.cpp,
// engine/tier_requests.cpp).
#include "plan/groups.h"
#include "plan/plan.h"

#include <cstddef>
#include <vector>

namespace torch_mgpu::plan {

// Parts of a split graph beyond this many: compiled whole instead (each
// part is a compile).
constexpr size_t kMaxParts = 16;

// A graph's nodes (`cost[k]` seconds, reading the earlier nodes
// `preds[k]`) taken in pieces (`pieces`: node indices, each node in at most
// one): each piece's seconds (its nodes' sum), the pieces it reads (none
// twice, never itself) and each node's piece (-1: none), for a schedule of
// the pieces (make_tasks).
struct PricedPieces {
  std::vector<double> seconds;
  std::vector<std::vector<int>> preds;
  std::vector<int> piece_of;  // by node
};
PricedPieces price_pieces(const std::vector<std::vector<int>>& pieces, const std::vector<double>& cost,
                          const std::vector<std::vector<int>>& preds);

// The makespan of pieces (seconds each, predecessors earlier pieces), each
// paying a compiled call, list-scheduled over `t`'s lanes.
double pieces_makespan(const Topology& t, const CostModel& cm, std::vector<double> seconds,
                       const std::vector<std::vector<int>>& preds);

// A graph's nodes (`cost[k]` seconds on one of `t`'s lanes, reading the
// earlier nodes `preds[k]`) in groups worth compiling and calling apart
// (groups.h; `siblings`: small siblings bundled), in a topological order,
// list-scheduled over the lanes (each paying a call): `lane_of` each
// group's lane, `makespan` the schedule's (one group of every node where
// none are found).
struct ScheduledGroups {
  std::vector<std::vector<int>> groups;
  std::vector<int> lane_of;
  double makespan = 0;
};
ScheduledGroups schedule_groups(const Topology& t, const CostModel& cm, const std::vector<double>& cost,
                                const std::vector<std::vector<int>>& preds, bool siblings);

// Whether pieces predicted to take `makespan` on the lanes beat running
// work of `total` seconds as one piece (by kMinSplitGain).
bool worth_splitting(double makespan, double total, const CostModel& cm);

// The groups on each lane joined into as few parts as keep the lanes
// apart: a lane's groups, in order, join its current part until one reads
// from a part (on another lane) that the current part does not already
// wait for, or follows a group another lane needs before the rest (a trunk
// and its heads); that group starts the lane's next part. A part then
// waits for others only before it starts, and only for parts that do not
// wait for it (counting each lane's order of parts as waits too): lanes
// that run their parts in order cannot wait for each other in a circle.
// `deps[i]`: the nodes node i reads; `groups` in a topological order;
// `lane` per group, then per part.
std::vector<std::vector<int>> join_along_lanes(const std::vector<std::vector<int>>& deps,
                                               const std::vector<std::vector<int>>& groups, std::vector<int>& lane);

// The parts of a graph (`cost[k]` seconds of node k on one of `t`'s lanes,
// `deps[k]` the nodes it reads) worth compiling apart and running side by
// side on the lanes: the groups (siblings bundled), each on the lane the
// list schedule gives it, a lane's groups joined into parts
// (join_along_lanes); `part_lane` each part's lane, `part_of` each node's
// part. Empty where the parts (each paying a call, waiting for the parts
// it reads and its lane's previous part) are not predicted to beat one
// piece, or there are more than kMaxParts.
std::vector<std::vector<int>> split_along_lanes(const Topology& t, const CostModel& cm, const std::vector<double>& cost,
                                                const std::vector<std::vector<int>>& deps, std::vector<int>& part_lane,
                                                std::vector<int>& part_of);

} // namespace torch_mgpu::plan
