#pragma once
// What plans ran or would run: last_plan(), simulate() and their records
// (internal to engine/).
#include "engine/execution.h"

#include <memory>

namespace torch_mgpu::engine {

// The record of plan `p` for graph `g`, with what execution `r` measured
// (null: simulated).
std::shared_ptr<PlanRecord> describe(const ir::Graph& g, const plan::Plan& p, const runtime::ExecResult* r);
// Makes `record` what last_plan() returns. Under the state lock.
void set_last_plan(std::shared_ptr<const PlanRecord> record);

} // namespace torch_mgpu::engine
