#pragma once
#include "plan/cost_model.h"

#include <c10/core/Device.h>

namespace torch_mgpu::runtime {

// Measures this machine's CPU lane rates (GEMM, elementwise, memory, per-op
// and launch overheads) in a few tens of milliseconds.
plan::CostModel calibrate_cpu(int cores);

// Measures a device lane's rates (cuda:N): the same figures, timed on the
// device's current stream, with host-to-device copies as the transfer rate.
plan::CostModel calibrate_device(c10::Device device);

} // namespace torch_mgpu::runtime
