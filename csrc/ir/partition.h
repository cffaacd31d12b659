#pragma once
// A compiled partition: a piece of a torch.compile graph that an outside
// compiler (inductor) turned into one callable. The IR runs it as one node
// of the op `torch_mgpu::partition(Partition p, Tensor[] inputs) -> Tensor[]`;
// the planner sees its cost figures, the executor calls `run` on a lane.
#include "ir/node.h"

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace torch_mgpu::ir {

struct Partition : torch::CustomClassHolder {
  // The compiled code: tensors on the lane's device in, fresh tensors out
  // (the executor copies any output that aliases an input or has another
  // geometry than `outputs` says).
  using Fn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
  Fn run;
  uint64_t id = 0;           // unique in the process: hashes and names tell partitions apart
  std::string_view name;     // interned: "partition#3[mm, relu, add; 2 kernels]", the node's name
  std::vector<std::string> ops;  // the ATen ops it computes, in order
  int kernels = 0;           // compiled kernels it launches
  // The geometries it was compiled for (dense outputs at offset 0).
  std::vector<TensorGeometry> inputs, outputs;
  // Its work, for the cost model: product flops, elementwise and
  // transcendental outputs, bytes read and written.
  double gemm_flops = 0, elem = 0, transcendental = 0, bytes = 0;
  // Intra-op threads its compiled loops use (0: as many as the lane has).
  int threads = 0;
};

// Makes a partition with a fresh id and its interned name.
c10::intrusive_ptr<Partition> make_partition(Partition::Fn run, std::vector<std::string> ops, int kernels,
                                             std::vector<TensorGeometry> inputs,
                                             std::vector<TensorGeometry> outputs);

// The partition an IValue holds (a `torch_mgpu.Partition` object), or null.
const Partition* partition_of(const c10::IValue& v);
// The partition a node runs, or null for every other node.
const Partition* partition_of(const Node& n);

} // namespace torch_mgpu::ir
