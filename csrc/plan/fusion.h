#pragma once
// Pointwise fusion: runs of elementwise arithmetic (add, sub, mul, div,
// neg, relu) that follow one another on a lane become one pass over the elements,
// block by block, instead of one ATen call and one full-size result per op.
// Only ops whose result is one correctly rounded IEEE operation per element
// are fused, in float32 or float64 on contiguous tensors of one size, so a
// fused result equals eager PyTorch's bitwise. Operands from outside may be
// broadcast: a single element, a row repeated over leading dims (a bias),
// or a column repeated over trailing dims (per-row statistics). Intermediates that nothing
// outside the run reads are never materialized.
//
// A fusion is plain data decided per plan (it depends only on what the
// graph hash covers: ops, geometries, constant kinds, roots, edges), so a
// cached plan carries it; the values of tensor constants are read from the
// graph at each execution.
#include "ir/graph.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace torch_mgpu::plan {

enum class PointwiseOp : uint8_t { Add, Sub, Mul, Div, Neg, Relu };

struct PointwiseInput {
  enum class Kind : uint8_t { Step, External, Constant };
  Kind kind = Kind::External;
  // Step: an earlier step of the group; External: an entry of the group's
  // externals; Constant: the argument index in the step's node.
  int index = 0;
};

struct PointwiseStep {
  int node = 0;  // index in the graph
  PointwiseOp op = PointwiseOp::Add;
  int arity = 2;
  PointwiseInput in[2];
  bool materialize = false;  // a root, or read outside the group
  int slot = -1;             // scratch slot when not materialized
};

// A tensor read from outside the group: argument `arg` of node `node`,
// read elementwise (Same) or broadcast to the group's size: one element
// (Scalar), a block repeated along the leading dims (Inner: element j reads
// j % period), or each element repeated along the trailing dims (Outer:
// element j reads j / period).
struct FusedExternal {
  enum class Kind : uint8_t { Same, Scalar, Inner, Outer };
  int node = 0;
  int arg = 0;
  Kind kind = Kind::Same;
  int64_t period = 1;
};

struct FusedGroup {
  c10::ScalarType dtype = c10::ScalarType::Float;
  int64_t numel = 0;
  std::vector<PointwiseStep> steps;
  std::vector<FusedExternal> externals;
  int slots = 0;  // scratch blocks the non-materialized steps need at once
};

struct Fusion {
  std::vector<FusedGroup> groups;
  // Per node: the group it starts (its first step), -1 otherwise; and the
  // group it belongs to, -1 when not fused.
  std::vector<int> group_at, group_of;
};

// Groups consecutive fusable nodes of each lane of `lane_order`. A node
// joins a group only if every graph node it reads from outside the group
// comes before the group's first node in topological order, so no path
// leaves a group and comes back (the group runs as one unit).
Fusion fuse(const ir::Graph& g, const std::vector<std::vector<int>>& lane_order);

// Whether pointwise fusion is on: TORCH_MGPU_FUSION=0 turns it off.
bool fusion_enabled();

} // namespace torch_mgpu::plan
