// Pieces of a graph on the lanes (pieces.h).
#include "plan/pieces.h"

#include <algorithm>
#include <unordered_map>

namespace torch_mgpu::plan {

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

double pieces_makespan(const Topology& t, const CostModel& cm, std::vector<double> seconds,
                       const std::vector<std::vector<int>>& preds) {
  for (double& s : seconds) s += cm.partition_call_s;
  return schedule_tasks(t, cm, make_tasks(std::move(seconds), preds)).makespan;
}

ScheduledGroups schedule_groups(const Topology& t, const CostModel& cm, const std::vector<double>& cost,
                                const std::vector<std::vector<int>>& preds, bool siblings) {
  const size_t n = cost.size();
  const int lanes = static_cast<int>(t.lanes.size());
  double total = 0;
  for (double c : cost) total += c;
  std::vector<int> all(n);
  for (size_t k = 0; k < n; ++k) all[k] = static_cast<int>(k);
  ScheduledGroups out;
  out.groups = {all};
  out.lane_of.assign(1, 0);
  out.makespan = total + cm.partition_call_s;
  if (lanes < 2 || n < 2) return out;
  // Small: not worth a piece's call, or a sliver of the whole graph.
  auto groups = group_nodes(cost, preds, std::max(cm.partition_call_s, total / (16.0 * lanes)), siblings);
  if (groups.size() < 2) return out;
  PricedPieces priced = price_pieces(groups, cost, preds);
  for (double& s : priced.seconds) s += cm.partition_call_s;
  const auto sched = schedule_tasks(t, cm, make_tasks(std::move(priced.seconds), priced.preds));
  out.groups = std::move(groups);
  out.lane_of = sched.lane_of;
  out.makespan = sched.makespan;
  return out;
}

bool worth_splitting(double makespan, double total, const CostModel& cm) {
  return makespan * kMinSplitGain <= total + cm.partition_call_s;
}

std::vector<std::vector<int>> join_along_lanes(const std::vector<std::vector<int>>& deps,
                                               const std::vector<std::vector<int>>& groups, std::vector<int>& lane) {
  // A part also ends after a group that another lane reads without reading
  // the later groups of its lane (a trunk and its heads: the head on the
  // other lane waits for the trunk, not for the head after it).
  std::vector<int> group_of(deps.size(), -1);
  for (size_t k = 0; k < groups.size(); ++k)
    for (int i : groups[k]) group_of[static_cast<size_t>(i)] = static_cast<int>(k);
  std::vector<std::vector<int>> reads_of(groups.size());  // groups each reads, directly
  for (size_t k = 0; k < groups.size(); ++k)
    for (int i : groups[k])
      for (int d : deps[static_cast<size_t>(i)]) {
        const int j = group_of[static_cast<size_t>(d)];
        auto& r = reads_of[k];
        if (j != static_cast<int>(k) && std::find(r.begin(), r.end(), j) == r.end()) r.push_back(j);
      }
  std::vector<char> cut_after(groups.size(), 0);
  for (size_t r = 0; r < groups.size(); ++r)
    for (int k : reads_of[r]) {
      if (lane.at(static_cast<size_t>(k)) == lane.at(r)) continue;
      bool later = false;  // does r read a later group of k's lane?
      for (int j : reads_of[r]) later = later || (j > k && lane.at(static_cast<size_t>(j)) == lane.at(static_cast<size_t>(k)));
      if (!later) cut_after[static_cast<size_t>(k)] = 1;
    }
  std::vector<std::vector<int>> parts, after;  // after[c]: parts c reads (and its lane's previous part)
  std::vector<int> part_lane;
  std::vector<int> part_of(deps.size(), -1);
  std::unordered_map<int, int> current;  // lane -> its current part
  std::unordered_map<int, bool> closed;  // lane -> its current part takes no more groups
  std::vector<char> seen;
  auto waits_for = [&](int from, int to) {
    seen.assign(parts.size(), 0);
    std::vector<int> stack{from};
    while (!stack.empty()) {
      const int c = stack.back();
      stack.pop_back();
      if (c == to) return true;
      if (seen[static_cast<size_t>(c)]) continue;
      seen[static_cast<size_t>(c)] = 1;
      for (int d : after[static_cast<size_t>(c)]) stack.push_back(d);
    }
    return false;
  };
  for (size_t k = 0; k < groups.size(); ++k) {
    const int l = lane.at(k);
    auto it = current.find(l);
    int c = it == current.end() ? -1 : it->second;
    std::vector<int> reads;
    for (int i : groups[k])
      for (int d : deps[static_cast<size_t>(i)]) {
        const int pd = part_of[static_cast<size_t>(d)];
        if (pd >= 0 && std::find(reads.begin(), reads.end(), pd) == reads.end()) reads.push_back(pd);
      }
    bool fits = c >= 0 && !closed[l];
    for (int pd : reads)
      if (fits && pd != c && !waits_for(c, pd)) fits = false;
    if (!fits) {
      parts.emplace_back();
      after.emplace_back();
      part_lane.push_back(l);
      if (c >= 0) after.back().push_back(c);
      c = static_cast<int>(parts.size()) - 1;
      current[l] = c;
    }
    closed[l] = cut_after[k] != 0;
    auto& a = after[static_cast<size_t>(c)];
    for (int pd : reads)
      if (pd != c && std::find(a.begin(), a.end(), pd) == a.end()) a.push_back(pd);
    for (int i : groups[k]) {
      part_of[static_cast<size_t>(i)] = c;
      parts[static_cast<size_t>(c)].push_back(i);
    }
  }
  for (auto& p : parts) std::sort(p.begin(), p.end());
  lane = std::move(part_lane);
  return parts;
}


std::vector<std::vector<int>> split_along_lanes(const Topology& t, const CostModel& cm, const std::vector<double>& cost,
                                                const std::vector<std::vector<int>>& deps, std::vector<int>& part_lane,
                                                std::vector<int>& part_of) {
  part_lane.clear();
  const int lanes = static_cast<int>(t.lanes.size());
  if (lanes < 2 || cost.size() < 2 || deps.size() != cost.size()) return {};
  double total = 0;
  for (double c : cost) total += c;
  ScheduledGroups sched = schedule_groups(t, cm, cost, deps, /*siblings=*/true);
  if (sched.groups.size() < 2) return {};
  part_lane = std::move(sched.lane_of);
  auto parts = join_along_lanes(deps, sched.groups, part_lane);
  if (parts.size() < 2 || parts.size() > kMaxParts) {
    part_lane.clear();
    return {};
  }
  // The parts' own schedule: each pays one call, and waits for the parts
  // it reads and its lane's previous part.
  PricedPieces priced = price_pieces(parts, cost, deps);
  for (size_t c = 0; c < parts.size(); ++c)
    for (size_t d = c; d-- > 0;)
      if (part_lane[d] == part_lane[c]) {
        auto& pp = priced.preds[c];
        if (std::find(pp.begin(), pp.end(), static_cast<int>(d)) == pp.end()) pp.push_back(static_cast<int>(d));
        break;
      }
  if (!worth_splitting(pieces_makespan(t, cm, priced.seconds, priced.preds), total, cm)) {
    part_lane.clear();
    return {};
  }
  part_of = std::move(priced.piece_of);
  return parts;
}

} // namespace torch_mgpu::plan
