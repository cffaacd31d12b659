#pragma once
// A plan over lanes on other ranks, corrected where a node's rank matters
// more than the list schedule saw: nodes a worker cannot be sent (can_send
// false: a constant that is not plain data) move to this process's first
// lane, and short nodes whose readers all run on one lane move to it when
// their result would otherwise cross ranks (kept where the model predicts
// the plan no slower). Each move reorders the lanes by predicted start and
// re-simulates the plan.
#include "ir/graph.h"
#include "plan/plan.h"

#include <functional>
#include <vector>

namespace torch_mgpu::plan {

using CanSend = std::function<bool(const ir::Node&)>;

// `scale`: per node, Work::scale (as make_plan took it).
void place_for_ranks(const ir::Graph& g, const Topology& topo, const CostModel& cm, const std::vector<double>& scale,
                     Plan& p, const CanSend& can_send);

} // namespace torch_mgpu::plan
