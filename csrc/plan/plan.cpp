// The policies (serial, heft, auto) that make a graph's plan, the estimate
// they share, in-place reuse and lane use.
#include "plan/plan.h"
#include "plan/schedule.h"

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

} // namespace

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
  Plan p = detail::list_schedule(g, t, cm, detail::node_tasks(g, sh.e, cm, t.threads_per_lane(static_cast<int>(t.lanes.size()))));
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
  Plan chains = detail::list_schedule(g, t, cm, detail::chain_tasks(g, sh.e, cm, threads));
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
