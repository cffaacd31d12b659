#pragma once
// Inside plan/: the list scheduler's pieces the policies (plan.cpp) build
// plans from. Not for other layers: they call make_plan or schedule_tasks.
#include "plan/plan.h"

namespace torch_mgpu::plan::detail {

// One task per node, each priced on `threads` threads.
Tasks node_tasks(const ir::Graph& g, const Estimate& e, const CostModel& cm, int threads);
// One task per chain of nodes (a node with one reader that reads only it,
// contracted), each priced on `threads` threads.
Tasks chain_tasks(const ir::Graph& g, const Estimate& e, const CostModel& cm, int threads);
// The plan of `ts` list-scheduled onto t's lanes (lane and order per node;
// no times: finish_plan simulates them).
Plan list_schedule(const ir::Graph& g, const Topology& t, const CostModel& cm, const Tasks& ts);

} // namespace torch_mgpu::plan::detail
