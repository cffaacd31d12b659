#pragma once
#include "plan/topology.h"

namespace torch_mgpu::runtime {

// Measures this machine's CPU lane rates (GEMM, elementwise, memory, per-op
// and launch overheads) in a few tens of milliseconds.
plan::CostModel calibrate_cpu(int cores);

} // namespace torch_mgpu::runtime
