#pragma once
// Plans by graph hash, refined once by what their first runs measured
// (internal to engine/).
#include "engine/execution.h"

#include <memory>

namespace torch_mgpu::engine {

// The plan for `g` on lanes `l`: the cached one, or a new one (cached).
std::shared_ptr<const plan::Plan> plan_for(const ir::Graph& g, const Lanes& l);
// Records what a run of cached plan `p` measured, and plans the graph again
// with the measured scales when its first runs are in (see CachedPlan).
void learn(const ir::Graph& g, const Lanes& l, const std::shared_ptr<const plan::Plan>& p,
           const runtime::ExecResult& r);

} // namespace torch_mgpu::engine
