// The plan cache: a plan per graph hash and lanes, refined once by the
// measured times of its first runs.
#include "engine/plan_cache.h"
#include "plan/ranks.h"
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

plan::Plan make_plan_for(const ir::Graph& g, const plan::Topology& topo, const plan::CostModel& cm,
                         const std::string& policy, bool streams, const std::vector<double>& scale) {
  // Plans that run on CPU lanes fuse runs of elementwise ops (plan/fusion.h);
  // stream lanes (CUDA, or CPU under the stream sanitizer) run every node alone.
  const bool fused = plan::fusion_enabled() && !topo.cuda && !streams;
  plan::Plan p = plan::make_plan(g, topo, cm, policy, fused, scale);
  if (topo.remote)
    plan::place_for_ranks(g, topo, cm, scale, p, [](const ir::Node& n) { return runtime::serializable(n); });
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
    const size_t way = e.trial ? 1 : 0;  // the plan, then one lane (ir::Trial's ways)
    e.times.record(way, r.makespan);
    if (!e.times.timed(way)) return;
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
    const bool one_lane_faster = e.times.choose() == 1;
    if (one_lane_faster) runtime::counters().plans_measured_slower++;
    else e.plan = std::move(e.kept);
    e.kept.reset();
    e.trial.reset();
    e.scale.clear();
    e.times = CachedPlan::one_lane_trial();
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

bool stream_lanes(const Lanes& l) { return !l.places.empty() && l.places[0].on_stream(); }

plan::Topology for_caller(const plan::Topology& t, int threads) {
  plan::Topology out = t;
  out.caller_threads = std::clamp(threads, 1, t.cores);
  return out;
}

} // namespace torch_mgpu::engine
