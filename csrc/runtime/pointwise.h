#pragma once
// Runs a fused group of elementwise steps (plan/fusion.h) on CPU memory:
// block by block, each step over the block, so that intermediates stay in
// small per-thread scratch blocks; large tensors split over the calling
// lane's intra-op threads.
#include "ir/graph.h"
#include "plan/fusion.h"

#include <vector>

namespace torch_mgpu::runtime {

// `external[j]`: first element of the group's external j (at its offset);
// `out[k]`: first element of step k's output when materialized, else null.
void run_pointwise(const ir::Graph& g, const plan::FusedGroup& grp, const std::vector<const void*>& external,
                   const std::vector<void*>& out);

} // namespace torch_mgpu::runtime
