#pragma once
// The IR: nodes that record one ATen op each, and Values that name one
// version of one storage. Plain data; nothing here runs an op.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Storage.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace torch_mgpu::ir {

// Sizes or strides: inline up to 6 dims, so recording a call allocates no
// memory for its geometries.
using Dims = c10::SmallVector<int64_t, 6>;

// Where a tensor lies inside its storage, as a strided view.
struct TensorGeometry {
  c10::ScalarType dtype = c10::ScalarType::Float;
  Dims sizes;
  Dims strides;
  int64_t offset = 0;
  bool conj = false;  // lazy conjugation bit (complex views)
  bool neg = false;   // lazy negation bit
  bool operator==(const TensorGeometry& o) const {
    return dtype == o.dtype && sizes == o.sizes && strides == o.strides &&
        offset == o.offset && conj == o.conj && neg == o.neg;
  }
  bool operator!=(const TensorGeometry& o) const { return !(*this == o); }
};

// A tensor argument: a strided view of one operand's storage.
struct TensorRef {
  int operand = 0;
  TensorGeometry geom;
  // A tensor passed to the call more than once (`topk(x, 2, out=(x, i))`)
  // has one number at every place it is passed, so that the kernel gets one
  // tensor there too (kernels allow a tensor to overlap itself, not an equal
  // view); -1 for a tensor passed once.
  int same = -1;
};

// One argument of the recorded call: a constant, or tensors that are views
// of the node's operands. Lists keep their optional holes (Tensor?[]).
struct Arg {
  enum class Kind : uint8_t { Constant, Tensor, TensorList, OptionalTensorList };
  Kind kind = Kind::Constant;
  c10::IValue constant;
  // Most arguments hold one tensor: kept inline, no allocation per argument.
  c10::SmallVector<std::optional<TensorRef>, 1> tensors;
};

// The process-wide settings that a kernel reads when it runs, as they were
// when the op was called: a node runs under its call's settings, not under
// whatever the program set since (docs/ARCHITECTURE.md, "Call state").
// Thread-local state (grad mode, autocast) needs no copy here: nodes run
// below autograd and autocast, whose work happened at the call.
struct CallState {
  c10::ScalarType default_dtype = c10::ScalarType::Float;
  bool deterministic = false;            // torch.use_deterministic_algorithms
  bool deterministic_warn_only = false;
  bool fill_uninitialized = true;        // torch.utils.deterministic.fill_uninitialized_memory
  int8_t matmul_precision = 0;           // torch.set_float32_matmul_precision (at::Float32MatmulPrecision)
  bool operator==(const CallState& o) const {
    return default_dtype == o.default_dtype && deterministic == o.deterministic &&
        deterministic_warn_only == o.deterministic_warn_only && fill_uninitialized == o.fill_uninitialized &&
        matmul_precision == o.matmul_precision;
  }
  bool operator!=(const CallState& o) const { return !(*this == o); }
};

// A tensor argument the op writes: `arg` is the argument's position,
// `element` its place in a tensor list (-1 for a plain tensor), `after` the
// geometry the mgpu tensor has after the call (Meta's: out= resizes it,
// resize_ and as_strided_ re-shape it). A kernel on a lane may leave its
// view another layout (a CPU out= kernel keeps its input's strides where
// Meta made them contiguous): the executor moves the bytes into `after`.
struct Written {
  int arg = 0;
  int element = -1;
  TensorGeometry after;
};

enum class NodeKind : uint8_t {
  Op,    // an ATen op to run
  Data,  // bytes already materialized (output 0 is `data`)
  Empty, // uninitialized bytes (torch.empty): allocated where first read
  Error  // a value whose computation failed; reading it raises `error`
};

struct Node;
using NodePtr = std::shared_ptr<Node>;

// One version of one storage: output `index` of `node`.
struct Value {
  NodePtr node;
  int index = 0;
  bool operator==(const Value& o) const {
    return node == o.node && index == o.index;
  }
};

// What one node output is: a fresh storage holding a returned tensor, or the
// next version of an operand's storage that the op wrote in place.
struct Output {
  size_t nbytes = 0;
  int mutated_operand = -1;  // -1: a fresh storage
  int returned = -1;         // fresh outputs: index in the flattened returns
  TensorGeometry geom;       // fresh outputs: the returned tensor's geometry
};

struct Node {
  NodeKind kind = NodeKind::Op;
  std::string_view name;  // "aten::add.Tensor", "data", "error": interned (see intern)
  std::optional<c10::OperatorHandle> op;
  // Most ops have a few arguments, operands and outputs: held inline, so
  // that recording an op allocates its node and little else.
  c10::SmallVector<Arg, 3> args;  // add, sub, where, addcmul...: 3
  // A node holds real references to its operands (the versions it reads).
  // Nothing points back from an operand to its users, so there is no cycle:
  // dropping the last tensor that needs a node frees it (dead-code
  // elimination by reference count).
  c10::SmallVector<Value, 2> operands;
  c10::SmallVector<Output, 1> outputs;
  c10::Storage data;   // Data nodes only
  // Data nodes on the host: a CPU tensor over `data`, the one an op at its
  // call last made or read it as (backend/eager.cpp), reused by the next op
  // that reads it with the same geometry. Under the state lock.
  at::Tensor host_view;
  // Data nodes: copies of `data` on other devices; Empty nodes: their bytes
  // once read. Data nodes: copies of `data` on other devices, made where lanes on
  // those devices read it (the bytes never change, so a copy stays valid).
  // A flight's lanes add them while the capture thread may read them: under
  // their own mutex. replica() is empty when there is none on `device`.
  c10::Storage replica(c10::Device device) const;
  void add_replica(c10::Storage copy) const;
  std::vector<c10::Storage> replicas() const;
  // The copy on `device`; where there is none, `make(any)` makes it (from
  // `any`, a copy on another device, or null where there is none yet) and
  // it is kept. One call at a time per node: an Empty node's bytes are
  // allocated once, by its first reader, and every later reader, on any
  // device, sees those same bytes (uninitialized, but one value).
  c10::Storage replica_or(c10::Device device, const std::function<c10::Storage(const c10::Storage* any)>& make) const;
  std::string error;   // Error nodes only
  // Ops that draw from a global generator with no Generator argument run
  // with this seed, so that results do not depend on the schedule.
  std::optional<uint64_t> seed;
  CallState state;     // Op nodes: the settings at the call
  // Op nodes: whether grad mode was on at the call (thread-local, so not a
  // CallState): a few CPU kernels read it (oneDNN's lstm runs its training
  // or its inference form, which part in the last place), and a lane runs
  // the op under the caller's.
  bool grad_mode = true;
  // Op nodes whose CPU kernel splits its work by the intra-op thread count
  // and so rounds by it (a reduction per thread, then their sum: layer and
  // batch norm's statistics and gradients, prod): the caller's count, which
  // a lane then runs it with (0: any count gives the same bits).
  int16_t call_threads = 0;
  std::vector<Written> written;  // Op nodes: the tensor arguments the op writes
  // Op nodes: where the op was called ("model.py:12"; interned), or empty
  // where no caller location is known (C++ programs): errors name it.
  std::string_view where;
  uint64_t id = 0;     // creation order: stable names in printouts

  Node();
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  bool is_pending() const { return kind == NodeKind::Op; }
  // Local structural hash: op, constants, geometries, output sizes;
  // materialized data hashes by size only, so a training loop hashes equal
  // from step to step. The graph hash adds the edges. Memoized.
  uint64_t hash() const;
  // hash() in two parts: everything but the operands (for an op, fixed by
  // its call's signature: capture keeps it with the signature), then
  // hash_from_prefix adds the operands and memoizes the whole (a node
  // whose hash is memoized already returns it, whatever the prefix).
  uint64_t hash_prefix() const;
  uint64_t hash_from_prefix(uint64_t prefix) const;

 private:
  mutable std::optional<uint64_t> hash_;
  mutable std::mutex replicas_mutex_;
  mutable std::vector<c10::Storage> replicas_;
};

// A string that lives as long as the process, equal to `s`: node names are
// views of these, so recording a node copies no string.
std::string_view intern(std::string_view s);

// A new node (an Op until its maker says otherwise). Nodes come from a pool
// of blocks their size: a node is larger than the allocator's per-thread
// caches take, and each allocation of that size made it sort its freed
// small chunks (malloc_consolidate) on the recording's path.
NodePtr new_node();

// A Data node over bytes that already exist.
NodePtr make_data(c10::Storage storage);
// An Empty node: `nbytes` uninitialized bytes.
NodePtr make_empty(size_t nbytes);
// An Error node: reading it raises `message`.
NodePtr make_error(std::string message, size_t nbytes);

// The id the next node will get: every node made before has a smaller one.
uint64_t next_node_id();
// Number of Op nodes alive and not yet executed.
int64_t pending_op_count();
// Called by the executor when it has run a node, so the node no longer
// counts as pending even while the graph still holds it.
void mark_executed(Node& node);

uint64_t hash_combine(uint64_t seed, uint64_t value);
// A constant argument's part of a node's hash: what a plan may depend on.
// Integers, booleans, strings, devices and tensor shapes by value; floating
// and complex numbers (learning rates, Adam's bias corrections, schedules:
// Python scalars that change every step without changing the program) by
// their class only (0, 1, or another value; fusion treats 1 specially), so
// a training loop's graph keeps its hash, and its plan, from step to step.
// A plan reads constant values from the graph it runs, never its own copy.
uint64_t hash_ivalue(const c10::IValue& v);

} // namespace torch_mgpu::ir
