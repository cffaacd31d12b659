#pragma once
// Plans by graph hash, refined once by what their first runs measured
// (internal to engine/).
#include "engine/execution.h"

#include <memory>
#include <string>
#include <vector>

namespace torch_mgpu::engine {

// Whether `l`'s lanes order work as streams (CUDA, or CPU lanes under the
// stream sanitizer) rather than host threads.
bool stream_lanes(const Lanes& l);
// `t` as a thread with `threads` intra-op threads plans on it: its one-lane
// plans run with that many (at most the cores).
plan::Topology for_caller(const plan::Topology& t, int threads);
// A plan for `g` on `topo`, as a sync makes it (fusion on CPU lanes that are
// not stream lanes; `scale`: measured corrections per node, or none): the
// one function behind the syncs' plans and simulate().
plan::Plan make_plan_for(const ir::Graph& g, const plan::Topology& topo, const plan::CostModel& cm,
                         const std::string& policy, bool stream_lanes, const std::vector<double>& scale = {});
// The plan the next sync of `g` would run, if the plan cache holds one made
// for lanes like `topo` (and its caller_threads) with `policy` (refined by
// measurement, perhaps).
std::shared_ptr<const plan::Plan> plan_if_cached(const ir::Graph& g, const plan::Topology& topo,
                                                 const std::string& policy);
// The plan for `g` on lanes `l`, synced from a thread with `caller_threads`
// intra-op threads: the cached one, or a new one (cached; one per graph and
// thread count).
std::shared_ptr<const plan::Plan> plan_for(const ir::Graph& g, const Lanes& l, int caller_threads);
// Records what a run of cached plan `p` measured, and plans the graph again
// with the measured scales when its first runs are in (see CachedPlan).
void learn(const ir::Graph& g, const Lanes& l, int caller_threads, const std::shared_ptr<const plan::Plan>& p,
           const runtime::ExecResult& r);

} // namespace torch_mgpu::engine
