// The plan cache: a plan per graph hash and lanes, refined once by the
// measured times of its first runs.
#include "engine/plan_cache.h"
#include "ir/env.h"
#include "engine/config.h"
#include "runtime/lanes.h"
#include "runtime/counters.h"
#include "runtime/serialize.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace torch_mgpu::engine {
namespace {

constexpr int kRefineRuns = 3;
constexpr double kRefineOff = 1.5;
// Nodes shorter than this, measured and predicted, keep scale 1: their times
// are mostly the clock and the call.
constexpr double kRefineMinSeconds = 50e-6;

bool refine_enabled() {
  static const bool on = ir::env::on_unless_zero(ir::env::Var::Refine);
  return on;
}


bool same_topology(const plan::Topology& a, const plan::Topology& b) {
  return a.devices == b.devices && a.lanes_per_device == b.lanes_per_device && a.cores == b.cores && a.cuda == b.cuda;
}

// The plan cache's key: a graph, and the caller's threads where they
// change its plans.
uint64_t plan_key(uint64_t hash, const plan::Topology& t) {
  const int threads = t.cuda ? 0 : t.one_lane_threads();
  return hash ^ (static_cast<uint64_t>(threads) * 0x9E3779B97F4A7C15ull);
}

} // namespace

namespace {
// Every lane runs its nodes by their predicted start (a node starts after
// what it reads ends, so the lanes' orders agree with the graph's), after
// nodes moved between lanes; then the lanes used and their threads, fusion
// groups, transfers and the predicted timeline follow the new lanes.
void reorder_lanes(const ir::Graph& g, const plan::Topology& topo, const plan::CostModel& cm,
                   const std::vector<double>& scale, plan::Plan& p) {
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
  std::vector<plan::Work> work(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    work[i] = plan::estimate_work(*g.nodes[i]);
    if (i < scale.size()) work[i].scale = scale[i];
  }
  plan::set_lane_use(g, topo, cm, work, p);  // moves may have emptied a lane
  if (!p.fusion.groups.empty()) plan::apply_fusion(g, topo, cm, work, p);
  else plan::simulate(g, topo, cm, work, p);
}

// Nodes a worker cannot be sent (a constant that is not plain data, such as
// a custom class) move to this process's first lane.
bool keep_unsendable_here(const ir::Graph& g, const plan::Topology& topo, plan::Plan& p) {
  int here = -1;
  for (size_t l = 0; l < topo.lanes.size() && here < 0; ++l)
    if (topo.lanes[l].rank == 0) here = static_cast<int>(l);
  if (here < 0) return false;  // no lane here: the node fails on its worker lane, naming its constant
  bool moved = false;
  for (size_t i = 0; i < g.size(); ++i)
    if (topo.lanes[p.lane_of[i]].rank != 0 && !runtime::serializable(*g.nodes[i])) {
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
bool pull_to_readers(const ir::Graph& g, const plan::Topology& topo, const plan::CostModel& cm, plan::Plan& p) {
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
        (topo.lanes[t].rank == 0 || runtime::serializable(*g.nodes[i]));
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

plan::Plan make_plan_for(const ir::Graph& g, const plan::Topology& topo, const plan::CostModel& cm,
                         const std::string& policy, bool streams, const std::vector<double>& scale) {
  // Plans that run on CPU lanes fuse runs of elementwise ops (plan/fusion.h);
  // stream lanes (CUDA, or CPU under the stream sanitizer) run every node alone.
  const bool fused = plan::fusion_enabled() && !topo.cuda && !streams;
  plan::Plan p = plan::make_plan(g, topo, cm, policy, fused, scale);
  if (topo.remote) {
    if (keep_unsendable_here(g, topo, p)) reorder_lanes(g, topo, cm, scale, p);
    // Kept where the model predicts it no slower.
    plan::Plan pulled = p;
    if (pull_to_readers(g, topo, cm, pulled)) {
      reorder_lanes(g, topo, cm, scale, pulled);
      if (pulled.predicted_makespan <= p.predicted_makespan) p = std::move(pulled);
    }
  }
  return p;
}

std::shared_ptr<const plan::Plan> plan_if_cached(const ir::Graph& g, const plan::Topology& topo,
                                                 const std::string& policy) {
  auto& c = config();
  std::lock_guard<std::mutex> lock(c.m);
  const CachedPlan* e = c.plans.peek(plan_key(g.hash, topo));
  if (!e || e->lanes != c.lanes.get() || !same_topology(c.lanes->topo, topo) || c.lanes->policy != policy)
    return nullptr;
  return e->plan;
}

std::shared_ptr<const plan::Plan> plan_for(const ir::Graph& g, const Lanes& l, int caller_threads) {
  const auto topo = for_caller(l.topo, caller_threads);
  if (runtime::in_forked_child())  // no lane threads here: one lane, the calling thread
    return std::make_shared<const plan::Plan>(
        plan::make_serial_plan(g, topo, cost_model(), plan::fusion_enabled() && !l.topo.cuda && !stream_lanes(l)));
  const auto& cm = cost_model();  // before the config lock: it reads the lanes
  const uint64_t key = plan_key(g.hash, topo);
  auto& c = config();
  std::lock_guard<std::mutex> lock(c.m);
  const CachedPlan* found = c.plans.find(key);  // a use
  if (found && found->lanes == &l) {
    runtime::counters().plan_cache_hits++;
    return found->plan;
  }
  auto p = std::make_shared<const plan::Plan>(make_plan_for(g, topo, cm, l.policy, stream_lanes(l)));
  runtime::counters().plans_built++;
  CachedPlan& e = c.plans.get(key);  // bounded: the least recently used plan goes
  e = CachedPlan();
  e.plan = p;
  e.lanes = &l;
  return p;
}

namespace {
// Whether `p` runs nodes on another rank.
bool uses_other_ranks(const plan::Plan& p) {
  for (size_t l = 0; l < p.lane_order.size(); ++l)
    if (!p.lane_order[l].empty() && p.lanes[l].rank != 0) return true;
  return false;
}
} // namespace

void learn(const ir::Graph& g, const Lanes& l, int caller_threads, const std::shared_ptr<const plan::Plan>& p,
           const runtime::ExecResult& r) {
  if (!refine_enabled() || cost_model_pinned() || r.first_error || r.timing.size() != g.size()) return;
  const auto& cm = cost_model();  // before the config lock: it reads the lanes
  const auto topo = for_caller(l.topo, caller_threads);
  auto& c = config();
  std::lock_guard<std::mutex> lock(c.m);
  CachedPlan* found = c.plans.peek(plan_key(g.hash, topo));
  if (!found || found->plan != p || found->settled) return;
  CachedPlan& e = *found;
  const size_t n = g.size();
  if (e.runs++ == 0) return;  // the cold run
  if (e.refined) {
    // Measuring the plan against one lane (below): its runs, then the
    // trial's; the faster stays.
    auto& times = e.trial ? e.trial_times : e.plan_times;
    times.push_back(r.makespan);
    if (times.size() < static_cast<size_t>(kRefineRuns)) return;
    if (!e.trial) {
      plan::Plan one = make_plan_for(g, topo, cm, "serial", stream_lanes(l), e.scale);
      one.policy = l.policy;
      e.trial = std::make_shared<const plan::Plan>(std::move(one));
      e.kept = std::move(e.plan);
      e.plan = e.trial;
      runtime::counters().plans_built++;
      return;
    }
    e.settled = true;
    const bool one_lane_faster = median(e.trial_times) < median(e.plan_times);
    if (one_lane_faster) runtime::counters().plans_measured_slower++;
    else e.plan = std::move(e.kept);
    e.kept.reset();
    e.trial.reset();
    e.scale.clear();
    e.plan_times.clear();
    e.trial_times.clear();
    return;
  }
  e.ratios.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const bool fused = !p->fusion.group_of.empty() && p->fusion.group_of[i] >= 0;  // a group's time, shared out
    const double measured = r.timing[i].end - r.timing[i].start;
    const double predicted = p->predicted_end[i] - p->predicted_start[i];
    if (fused || predicted <= 0 || std::max(measured, predicted) < kRefineMinSeconds) continue;
    e.ratios[i].push_back(measured / predicted);
  }
  if (e.runs <= kRefineRuns) return;
  e.refined = true;
  std::vector<double> scale(n, 1.0);
  bool off = false;
  for (size_t i = 0; i < n; ++i) {
    auto& v = e.ratios[i];
    if (v.size() < static_cast<size_t>(kRefineRuns)) continue;  // not measured in every run
    scale[i] = std::max(median(v), 1e-3);  // a node the model knows nothing of can be off by 100x and more
    off = off || scale[i] > kRefineOff || scale[i] < 1.0 / kRefineOff;
  }
  e.ratios.clear();
  if (off) {
    e.plan = std::make_shared<const plan::Plan>(make_plan_for(g, topo, cm, l.policy, stream_lanes(l), scale));
    runtime::counters().plans_built++;
  }
  // A plan with lanes on other ranks is measured against one lane of this
  // process (the first lane, where this process's devices come first)
  // before it is kept: what a value crossing ranks waits for (the
  // transport's threads getting a core on a busy machine, a halted idle
  // core waking) is milliseconds that no ping shows, and is not in the model.
  if (uses_other_ranks(*e.plan) && l.policy == "auto" && topo.lanes[0].rank == 0) {
    e.scale = std::move(scale);
  } else {
    e.settled = true;
  }
}

bool stream_lanes(const Lanes& l) { return !l.places.empty() && l.places[0].streams; }

plan::Topology for_caller(const plan::Topology& t, int threads) {
  plan::Topology out = t;
  out.caller_threads = std::clamp(threads, 1, t.cores);
  return out;
}

} // namespace torch_mgpu::engine
