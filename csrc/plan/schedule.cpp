// The list scheduler: tasks (nodes, or chains of them) by upward rank onto
// the lane with the earliest finish time (HEFT), for the policies
// (plan.cpp) and for callers with tasks of their own (schedule_tasks).
#include "plan/plan.h"
#include "plan/schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <map>
#include <queue>
#include <unordered_map>

namespace torch_mgpu::plan {

namespace {

// List scheduling of tasks (nodes or clusters of nodes) by upward rank onto
// the lane with the earliest finish time (HEFT, Topcuoglu et al. 2002).
// Each task's fill: its nodes' device_fill, weighted by their cost.
void set_fill(const Estimate& e, const CostModel& cm, int threads, Tasks& ts) {
  ts.fill.assign(ts.members.size(), 1.0);
  if (cm.sms <= 0) return;
  for (size_t t = 0; t < ts.members.size(); ++t) {
    double weighted = 0, total = 0;
    for (int i : ts.members[t]) {
      const double c = node_seconds(e.work[i], cm, threads);
      weighted += c * device_fill(e.work[i], cm);
      total += c;
    }
    ts.fill[t] = total > 0 ? weighted / total : 1.0;
  }
}

TaskSchedule schedule_tasks_impl(const Topology& t, const CostModel& cm, const Tasks& ts) {
  const size_t m = ts.members.size();
  const auto& lanes = t.lanes;
  // Mean cost of an edge between two different lanes (HEFT's average).
  auto mean_comm = [&](int a) {
    bool multi_device = t.devices.size() > 1;
    double c = cm.lane_sync_s;
    if (multi_device) c += cm.transfer_latency_s + ts.out_bytes[a] / cm.transfer_bytes_per_s;
    return c;
  };
  // Tasks come in topological order (members are built in node order and
  // every edge goes from a lower to a higher first member).
  std::vector<int> topo(m);
  for (size_t k = 0; k < m; ++k) topo[k] = static_cast<int>(k);
  std::sort(topo.begin(), topo.end(), [&](int a, int b) { return ts.members[a][0] < ts.members[b][0]; });
  std::vector<double> rank(m, 0.0);
  for (auto it = topo.rbegin(); it != topo.rend(); ++it) {
    int a = *it;
    double best = 0;
    for (int s : ts.succs[a]) best = std::max(best, mean_comm(a) + rank[s]);
    rank[a] = ts.cost[a] + best;
  }
  // Highest rank first, but never before a predecessor.
  std::vector<int> order;
  std::vector<int> missing(m);
  for (size_t k = 0; k < m; ++k) missing[k] = static_cast<int>(ts.preds[k].size());
  auto before = [&](int a, int b) {  // heap order: highest rank first, then earliest node
    return rank[a] < rank[b] || (rank[a] == rank[b] && ts.members[a][0] > ts.members[b][0]);
  };
  std::priority_queue<int, std::vector<int>, decltype(before)> ready(before);
  for (size_t k = 0; k < m; ++k)
    if (!missing[k]) ready.push(static_cast<int>(k));
  while (!ready.empty()) {
    int a = ready.top();
    ready.pop();
    order.push_back(a);
    for (int s2 : ts.succs[a])
      if (--missing[s2] == 0) ready.push(s2);
  }
  std::vector<double> lane_free(lanes.size(), 0.0), finish(m, 0.0);
  for (size_t l = 0; l < lanes.size(); ++l)
    if (lanes[l].rank) lane_free[l] = cm.network_latency_s;  // its program's way there
  std::vector<int> lane_of_task(m, 0);
  // GPUs: what each lane runs when (start, end, fill), in time order, so
  // that a task placed beside kernels on the same device's other streams
  // is slowed by the share of the device they take.
  struct Slot {
    double start, end, fill;
  };
  std::vector<std::vector<Slot>> slots(cm.sms > 0 ? lanes.size() : 0);
  auto device_load = [&](size_t lane, double at) {
    double load = 0;
    for (size_t o = 0; o < slots.size(); ++o) {
      if (o == lane || lanes[o].device != lanes[lane].device) continue;
      const auto& v = slots[o];
      auto it = std::upper_bound(v.begin(), v.end(), at, [](double x, const Slot& s) { return x < s.end; });
      if (it != v.end() && it->start <= at) load += it->fill;
    }
    return load;
  };
  for (int a : order) {
    int best_lane = 0;
    double best_end = 0, best_start = 0;
    for (size_t l = 0; l < lanes.size(); ++l) {
      double start = lane_free[l];
      for (int p : ts.preds[a]) {
        const Lane& from = lanes[lane_of_task[p]];
        start = std::max(start, finish[p] + edge_seconds(ts.out_bytes[p], from, lanes[l], cm));
      }
      double end = start + ts.cost[a];
      if (!slots.empty()) end = start + ts.cost[a] * std::max(1.0, device_load(l, start) + ts.fill[a]);
      if (lanes[l].rank) end += call_seconds(lanes[l], cm) * static_cast<double>(std::max<size_t>(1, ts.members[a].size()));
      if (l == 0 || end < best_end - 1e-12) {
        best_end = end;
        best_start = start;
        best_lane = static_cast<int>(l);
      }
    }
    if (!slots.empty()) slots[best_lane].push_back({best_start, best_end, ts.fill[a]});
    lane_of_task[a] = best_lane;
    finish[a] = best_end;
    lane_free[best_lane] = best_end;
  }
  TaskSchedule out;
  out.order = std::move(order);
  out.lane_of = std::move(lane_of_task);
  out.finish = std::move(finish);
  for (double f : out.finish) out.makespan = std::max(out.makespan, f);
  return out;
}

} // namespace

namespace detail {

Tasks node_tasks(const ir::Graph& g, const Estimate& e, const CostModel& cm, int threads) {
  Tasks ts;
  const size_t n = g.size();
  ts.members.resize(n);
  ts.task_of.resize(n);
  ts.cost.resize(n);
  ts.preds = g.deps;
  ts.succs = g.users;
  ts.out_bytes.assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    ts.members[i] = {static_cast<int>(i)};
    ts.task_of[i] = static_cast<int>(i);
    ts.cost[i] = node_seconds(e.work[i], cm, threads);
    for (const auto& o : g.nodes[i]->outputs) ts.out_bytes[i] += static_cast<double>(o.nbytes);
  }
  set_fill(e, cm, threads, ts);
  return ts;
}

// Chains (a node whose only producer has it as only consumer) become one
// task, so that cheap ops never ping-pong between lanes.
Tasks chain_tasks(const ir::Graph& g, const Estimate& e, const CostModel& cm, int threads) {
  const size_t n = g.size();
  Tasks ts;
  ts.task_of.assign(n, -1);
  for (size_t i = 0; i < n; ++i) {
    int t;
    if (g.deps[i].size() == 1 && g.users[g.deps[i][0]].size() == 1) {
      t = ts.task_of[g.deps[i][0]];
    } else {
      t = static_cast<int>(ts.members.size());
      ts.members.emplace_back();
      ts.cost.push_back(0.0);
      ts.out_bytes.push_back(0.0);
    }
    ts.task_of[i] = t;
    ts.members[t].push_back(static_cast<int>(i));
    ts.cost[t] += node_seconds(e.work[i], cm, threads);
    ts.out_bytes[t] = 0;
    for (const auto& o : g.nodes[i]->outputs) ts.out_bytes[t] += static_cast<double>(o.nbytes);
  }
  ts.preds.assign(ts.members.size(), {});
  ts.succs.assign(ts.members.size(), {});
  for (size_t i = 0; i < n; ++i)
    for (int d : g.deps[i]) {
      int a = ts.task_of[d], b = ts.task_of[i];
      if (a == b) continue;
      if (std::find(ts.preds[b].begin(), ts.preds[b].end(), a) == ts.preds[b].end()) {
        ts.preds[b].push_back(a);
        ts.succs[a].push_back(b);
      }
    }
  set_fill(e, cm, threads, ts);
  return ts;
}

Plan list_schedule(const ir::Graph& g, const Topology& t, const CostModel& cm, const Tasks& ts) {
  const TaskSchedule sched = schedule_tasks_impl(t, cm, ts);
  const auto& order = sched.order;
  const auto& lane_of_task = sched.lane_of;
  const auto& lanes = t.lanes;
  Plan p;
  p.lane_of.assign(g.size(), 0);
  p.lane_order.assign(lanes.size(), {});
  for (int a : order)
    for (int i : ts.members[a]) {
      p.lane_of[i] = lane_of_task[a];
      p.lane_order[lane_of_task[a]].push_back(i);
    }
  return p;
}

} // namespace detail

Tasks make_tasks(std::vector<double> cost, const std::vector<std::vector<int>>& preds, std::vector<double> out_bytes) {
  const size_t m = cost.size();
  TORCH_CHECK(preds.size() == m, "torch_mgpu: ", m, " task costs but ", preds.size(), " predecessor lists");
  TORCH_CHECK(out_bytes.empty() || out_bytes.size() == m, "torch_mgpu: ", m, " task costs but ", out_bytes.size(),
              " output sizes");
  Tasks ts;
  ts.members.resize(m);
  ts.task_of.resize(m);
  ts.preds.assign(m, {});
  ts.succs.assign(m, {});
  for (size_t k = 0; k < m; ++k) {
    ts.members[k] = {static_cast<int>(k)};
    ts.task_of[k] = static_cast<int>(k);
    for (int p : preds[k]) {
      TORCH_CHECK(p >= 0 && static_cast<size_t>(p) < k, "torch_mgpu: task ", k, " has predecessor ", p,
                  ": tasks must come after the tasks they read");
      if (std::find(ts.preds[k].begin(), ts.preds[k].end(), p) != ts.preds[k].end()) continue;
      ts.preds[k].push_back(p);
      ts.succs[p].push_back(static_cast<int>(k));
    }
  }
  ts.cost = std::move(cost);
  ts.out_bytes = out_bytes.empty() ? std::vector<double>(m, 0.0) : std::move(out_bytes);
  ts.fill.assign(m, 1.0);
  return ts;
}

TaskSchedule schedule_tasks(const Topology& t, const CostModel& cm, const Tasks& ts) {
  return schedule_tasks_impl(t, cm, ts);
}

} // namespace torch_mgpu::plan
