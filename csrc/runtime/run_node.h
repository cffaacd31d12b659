#pragma once
// Runs one node of a graph: what a lane does for each node it is given.
#include "ir/node.h"
#include "ir/view.h"
#include "runtime/place.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string>
#include <vector>

namespace torch_mgpu::runtime {

// A CPU tensor over `storage` (CPU bytes) with `geom`.
at::Tensor cpu_view(const c10::Storage& storage, const ir::TensorGeometry& geom);

// Where node `n` came from, for error messages: "aten::median.dim_values
// (op #12, called at model.py:3)".
std::string describe_node(const ir::Node& n);

// Whether node `n`'s op has a kernel for `place`'s device (a CUDA lane may
// be given an op recording chose for another device; it runs on the host).
bool runs_on(const ir::Node& n, const Place& place);

// Runs one node at `place` (its device, with its stream current). Operand
// bytes are on that device; `reuse[k]` lets the node write operand k in
// place, else it writes a copy.
std::vector<c10::Storage> run_node(const ir::Node& n, std::vector<c10::Storage> operands,
                                   const std::vector<bool>& reuse, const Place& place = Place());

} // namespace torch_mgpu::runtime
