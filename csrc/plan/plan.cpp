#include "plan/plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <map>
#include <queue>
#include <unordered_map>

namespace torch_mgpu::plan {

Estimate estimate(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<double>& scale) {
  Estimate e;
  const size_t n = g.size();
  e.work.resize(n);
  std::vector<double> finish(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    e.work[i] = estimate_work(*g.nodes[i]);
    if (i < scale.size()) e.work[i].scale = scale[i];
    double c = node_seconds(e.work[i], cm, 1);
    e.total_work += c;
    double start = 0;
    for (int d : g.deps[i]) start = std::max(start, finish[d]);
    finish[i] = start + c;
    e.critical_path = std::max(e.critical_path, finish[i]);
  }
  if (cm.sms > 0) {
    // GPUs: a device's streams share it, so the bound is the devices' time
    // (each kernel's device-seconds: its time alone times its fill).
    // Launches are the host's: each lane's thread queues its own.
    double device_seconds = 0, launches = 0;
    for (size_t i = 0; i < n; ++i) {
      const double launch = launch_seconds(e.work[i], cm);
      device_seconds += std::max(0.0, node_seconds(e.work[i], cm, 1) - launch) * device_fill(e.work[i], cm);
      launches += launch;
    }
    e.lower_bound = std::max({e.critical_path, device_seconds / std::max<size_t>(1, t.devices.size()),
                              launches / std::max<size_t>(1, t.lanes.size())});
    return e;
  }
  e.lower_bound = std::max(e.critical_path, e.total_work / std::max<size_t>(1, t.lanes.size()));
  return e;
}

void bounds_from_plan(const ir::Graph& g, const Plan& p, int lanes, Estimate& e) {
  const size_t n = g.size();
  std::vector<double> finish(n, 0.0);
  e.critical_path = e.total_work = 0;
  for (size_t i = 0; i < n; ++i) {
    const double c = std::max(0.0, p.predicted_end[i] - p.predicted_start[i]);
    double start = 0;
    for (int d : g.deps[i]) start = std::max(start, finish[d]);
    finish[i] = start + c;
    e.critical_path = std::max(e.critical_path, finish[i]);
    e.total_work += c;
  }
  e.lower_bound = std::max(e.critical_path, e.total_work / std::max(1, lanes));
}

void compute_reuse(const ir::Graph& g, Plan& p) {
  // Readers per value: graph outputs by (index, output); materialized
  // operands by node pointer (they have one output).
  std::vector<std::vector<int>> graph_readers(g.size());
  for (size_t i = 0; i < g.size(); ++i) graph_readers[i].assign(g.nodes[i]->outputs.size(), 0);
  std::unordered_map<const ir::Node*, int> leaf_readers;
  for (const auto& node : g.nodes)
    for (const auto& v : node->operands) {
      const int d = g.find(v.node.get());
      if (d >= 0) graph_readers[d][v.index]++;
      else leaf_readers[v.node.get()]++;
    }
  std::vector<std::vector<bool>> is_root(g.size());
  for (size_t i = 0; i < g.size(); ++i) is_root[i].assign(g.nodes[i]->outputs.size(), false);
  for (const auto& r : g.roots) {
    const int d = g.find(r.node.get());
    if (d >= 0) is_root[d][r.index] = true;
  }
  p.reuse.assign(g.size(), {});
  for (size_t i = 0; i < g.size(); ++i) {
    const auto& n = *g.nodes[i];
    p.reuse[i].assign(n.operands.size(), false);
    for (const auto& o : n.outputs) {
      if (o.mutated_operand < 0) continue;
      const auto& v = n.operands[o.mutated_operand];
      const int d = g.find(v.node.get());
      bool only = d >= 0 ? graph_readers[d][v.index] == 1 && !is_root[d][v.index] : leaf_readers[v.node.get()] == 1;
      p.reuse[i][o.mutated_operand] = only;
    }
  }
}

void apply_fusion(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work,
                  Plan& p) {
  p.fusion = fuse(g, p.lane_order);
  if (p.fusion.groups.empty()) return;
  std::vector<Work> fused = work;
  for (const auto& grp : p.fusion.groups)
    for (size_t k = 1; k < grp.steps.size(); ++k) fused[grp.steps[k].node].fused = true;
  simulate(g, t, cm, fused, p);
}

void simulate(const ir::Graph& g, const Topology& t, const CostModel& cm, Plan& p) {
  std::vector<Work> work(g.size());
  for (size_t i = 0; i < g.size(); ++i) work[i] = estimate_work(*g.nodes[i]);
  simulate(g, t, cm, work, p);
}

namespace {
// GPU lanes: the streams of a device share it. Each lane runs its nodes in
// order; a node is launched (launch_seconds: the host's part, not shared)
// once its lane is free and its inputs have arrived, then its kernel's work
// (seconds alone on the device) advances at min(1, 1 / the summed fill of
// the kernels running on that device at the time).
void simulate_shared(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work,
                     const std::vector<double>& bytes_of, Plan& p) {
  const size_t n = g.size();
  const size_t lanes = p.lane_order.size();
  std::vector<double> fill(n), launch(n), rest(n);
  for (size_t i = 0; i < n; ++i) {
    fill[i] = device_fill(work[i], cm);
    launch[i] = launch_seconds(work[i], cm);
    rest[i] = std::max(0.0, node_seconds(work[i], cm, 1) - launch[i]);
  }
  enum class Phase { Idle, Launching, Running };
  std::vector<size_t> head(lanes, 0);
  std::vector<int> current(lanes, -1);
  std::vector<Phase> phase(lanes, Phase::Idle);
  std::vector<double> launched_at(lanes, 0.0);
  std::vector<double> lane_free(lanes, p.lanes_used > 1 ? cm.launch_s : 0.0);
  std::vector<bool> done(n, false);
  std::vector<double> load(t.devices.size(), 0.0);
  size_t remaining = n;
  double now = 0, makespan = 0;
  constexpr double eps = 1e-15;
  while (remaining) {
    for (size_t l = 0; l < lanes; ++l) {
      if (current[l] >= 0 || head[l] >= p.lane_order[l].size()) continue;
      const int i = p.lane_order[l][head[l]];
      double start = std::max(now, lane_free[l]);
      bool ready = true;
      for (int d : g.deps[i]) {
        ready &= done[d];
        if (done[d])
          start = std::max(start, p.predicted_end[d] + edge_seconds(bytes_of[d], p.lanes[p.lane_of[d]], p.lanes[l], cm));
      }
      if (!ready) continue;
      current[l] = i;
      phase[l] = Phase::Launching;
      p.predicted_start[i] = start;
      launched_at[l] = start + launch[i];
    }
    std::fill(load.begin(), load.end(), 0.0);
    for (size_t l = 0; l < lanes; ++l)
      if (phase[l] == Phase::Running) load[p.lanes[l].device] += fill[current[l]];
    auto speed = [&](size_t l) { return std::min(1.0, 1.0 / std::max(load[p.lanes[l].device], eps)); };
    double next = std::numeric_limits<double>::infinity();
    for (size_t l = 0; l < lanes; ++l) {
      if (phase[l] == Phase::Launching) next = std::min(next, launched_at[l]);
      if (phase[l] == Phase::Running) next = std::min(next, now + rest[current[l]] / speed(l));
    }
    TORCH_INTERNAL_ASSERT(next < std::numeric_limits<double>::infinity(),
                          "torch_mgpu: plan order deadlocks (lane orders contradict dependencies)");
    for (size_t l = 0; l < lanes; ++l)
      if (phase[l] == Phase::Running) rest[current[l]] -= (next - now) * speed(l);
    now = next;
    for (size_t l = 0; l < lanes; ++l) {
      if (phase[l] == Phase::Launching && launched_at[l] <= now + eps) phase[l] = Phase::Running;
      if (phase[l] == Phase::Running && rest[current[l]] <= 1e-12 * (1.0 + now)) {
        const int i = current[l];
        p.predicted_end[i] = now;
        makespan = std::max(makespan, now);
        done[i] = true;
        --remaining;
        lane_free[l] = now;
        current[l] = -1;
        phase[l] = Phase::Idle;
        ++head[l];
      }
    }
  }
  p.predicted_makespan = makespan;
}
} // namespace

void simulate(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work, Plan& p) {
  const size_t n = g.size();
  p.predicted_start.assign(n, 0.0);
  p.predicted_end.assign(n, 0.0);
  std::vector<double> bytes_of(n, 0.0);
  for (size_t i = 0; i < n; ++i)
    for (const auto& o : g.nodes[i]->outputs) bytes_of[i] += static_cast<double>(o.nbytes);
  if (cm.sms > 0) {
    simulate_shared(g, t, cm, work, bytes_of, p);
    return;
  }
  // Lanes advance in their order; a node waits for its inputs. Process nodes
  // in an order consistent with both (a topological order that respects each
  // lane's sequence): repeatedly take the lane head whose deps are done.
  std::vector<size_t> head(p.lane_order.size(), 0);
  std::vector<double> lane_free(p.lane_order.size(), p.lanes_used > 1 ? cm.launch_s : 0.0);
  for (size_t l = 0; l < p.lane_order.size(); ++l)
    if (p.lanes[l].rank) lane_free[l] += cm.network_latency_s;  // its program's way there
  std::vector<bool> done(n, false);
  size_t remaining = n;
  double makespan = 0;
  while (remaining) {
    bool progressed = false;
    for (size_t l = 0; l < p.lane_order.size(); ++l) {
      while (head[l] < p.lane_order[l].size()) {
        int i = p.lane_order[l][head[l]];
        bool ready = true;
        for (int d : g.deps[i]) ready &= done[d];
        if (!ready) break;
        double start = lane_free[l];
        for (int d : g.deps[i])
          start = std::max(start, p.predicted_end[d] + edge_seconds(bytes_of[d], p.lanes[p.lane_of[d]], p.lanes[l], cm));
        double end = start + node_seconds(work[i], cm, p.threads_per_lane) + call_seconds(p.lanes[l], cm);
        p.predicted_start[i] = start;
        p.predicted_end[i] = end;
        lane_free[l] = end;
        makespan = std::max(makespan, end);
        done[i] = true;
        --remaining;
        ++head[l];
        progressed = true;
      }
    }
    TORCH_INTERNAL_ASSERT(progressed, "torch_mgpu: plan order deadlocks (lane orders contradict dependencies)");
  }
  p.predicted_makespan = makespan;
}

namespace {

// Plain matrix products (not convolutions or attention, whose kernels split
// their work differently).
bool is_matrix_product(const ir::Node& n) {
  const std::string_view name = n.name;
  return name == "aten::mm" || name == "aten::bmm" || name == "aten::addmm" || name == "aten::baddbmm";
}

// Lanes used, threads, transfers, reuse (shared by every candidate plan of a
// graph: it depends on the graph only) and the simulated timeline.
void finish_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work,
                 const std::vector<std::vector<bool>>& reuse, Plan& p) {
  p.lanes = t.lanes;
  set_lane_use(g, t, cm, work, p);
  p.transfers = 0;
  for (size_t i = 0; i < g.size(); ++i)
    for (int d : g.deps[i])
      if (t.lanes[p.lane_of[d]].device != t.lanes[p.lane_of[i]].device) p.transfers++;
  p.reuse = reuse;
  simulate(g, t, cm, work, p);
}

struct Shared {
  Estimate e;
  std::vector<std::vector<bool>> reuse;
  Shared(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<double>& scale)
      : e(estimate(g, t, cm, scale)) {
    Plan tmp;
    compute_reuse(g, tmp);
    reuse = std::move(tmp.reuse);
  }
};

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

} // namespace

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

namespace {

// Every candidate ends here: the simulated timeline, then (for a plan that
// will run fused) fusion and the timeline again.
void finish(const ir::Graph& g, const Topology& t, const CostModel& cm, const Shared& sh, bool fuse, Plan& p) {
  finish_plan(g, t, cm, sh.e.work, sh.reuse, p);
  if (fuse) apply_fusion(g, t, cm, sh.e.work, p);
}

Plan serial_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, const Shared& sh, bool fuse) {
  Plan p;
  p.policy = "serial";
  p.lane_of.assign(g.size(), 0);
  p.lane_order.assign(t.lanes.size(), {});
  for (size_t i = 0; i < g.size(); ++i) p.lane_order[0].push_back(static_cast<int>(i));
  finish(g, t, cm, sh, fuse, p);
  return p;
}

Plan heft_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, const Shared& sh, bool fuse) {
  Plan p = list_schedule(g, t, cm, node_tasks(g, sh.e, cm, t.threads_per_lane(static_cast<int>(t.lanes.size()))));
  p.policy = "heft";
  finish(g, t, cm, sh, fuse, p);
  return p;
}

} // namespace

void set_lane_use(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work,
                  Plan& p) {
  int used = 0;
  for (const auto& o : p.lane_order) used += o.empty() ? 0 : 1;
  p.lanes_used = std::max(1, used);
  p.threads_per_lane = p.lanes_used == 1 ? t.one_lane_threads() : t.threads_per_lane(p.lanes_used);
  // One lane with all the cores: products too small to gain from threads
  // (the cost model's single-thread rate) run on one, so that they never
  // wake the intra-op team (a wake-up on a VM costs more than the product).
  // Matrix products give the same bits on any number of threads (each
  // output element is one thread's dot product).
  p.one_thread.clear();
  if (p.lanes_used == 1 && p.threads_per_lane > 1 && !t.cuda) {
    p.one_thread.assign(g.size(), 0);
    for (size_t i = 0; i < g.size(); ++i)
      p.one_thread[i] = work[i].gemm && work[i].flops < cm.parallel_min_flops && is_matrix_product(*g.nodes[i]);
  }
}

Plan make_serial_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, bool fuse,
                      const std::vector<double>& scale) {
  return serial_plan(g, t, cm, Shared(g, t, cm, scale), fuse);
}

Plan make_heft_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, bool fuse,
                    const std::vector<double>& scale) {
  return heft_plan(g, t, cm, Shared(g, t, cm, scale), fuse);
}

Plan make_auto_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, bool fuse,
                    const std::vector<double>& scale) {
  Shared sh(g, t, cm, scale);
  Plan serial = serial_plan(g, t, cm, sh, fuse);
  if (t.lanes.size() == 1 || g.size() < 2) {
    serial.policy = "auto";
    return serial;
  }
  int threads = t.threads_per_lane(static_cast<int>(t.lanes.size()));
  Plan chains = list_schedule(g, t, cm, chain_tasks(g, sh.e, cm, threads));
  finish(g, t, cm, sh, fuse, chains);
  Plan heft = heft_plan(g, t, cm, sh, fuse);
  // The best parallel prediction, kept only if it beats one lane by a
  // margin (predictions are estimates; one lane has no wake-up cost).
  Plan* best = chains.predicted_makespan <= heft.predicted_makespan ? &chains : &heft;
  if (!(best->predicted_makespan < 0.95 * serial.predicted_makespan)) best = &serial;
  best->policy = "auto";
  return std::move(*best);
}

Plan make_plan(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::string& policy, bool fuse,
               const std::vector<double>& scale) {
  Plan p;
  if (policy == "serial") {
    p = make_serial_plan(g, t, cm, fuse, scale);
  } else if (policy == "heft") {
    p = make_heft_plan(g, t, cm, fuse, scale);
  } else {
    TORCH_CHECK(policy == "auto", "torch_mgpu: unknown policy '", policy, "' (expected 'serial', 'heft' or 'auto')");
    p = make_auto_plan(g, t, cm, fuse, scale);
  }
  p.refined = !scale.empty();
  return p;
}

} // namespace torch_mgpu::plan
