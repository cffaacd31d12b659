#pragma once
// Tiered execution's Python face: the compile thread of torch_mgpu/_tiers/compile.py
// takes hot graphs (engine/tiers.h) as Python data and gives back compiled
// functions.
#include "ir/partition.h"

#include <pybind11/pybind11.h>

namespace torch_mgpu::python {

// A Python callable taking a list of tensors and returning a sequence of
// them, as C++ code calls it from any thread (with the GIL taken there).
ir::Partition::Fn tensors_fn(pybind11::function fn);

// _tier_* functions of torch_mgpu._C.
void bind_tiers(pybind11::module& m);

} // namespace torch_mgpu::python
