#pragma once
// The steps of recording a call (record.cpp), shared by the files that
// make them, inside capture/ only: the call's signature and Meta twins
// (signature.cpp), Meta inference (infer.cpp), the CPU probe (probe.cpp),
// layout corrections (layouts.cpp), and the per-op rules and checks at the
// call (op_rules.cpp). capture.h is the stage's interface.
#include "capture/arguments.h"
#include "capture/capture.h"
#include "capture/lazy_tensor.h"
#include "capture/meta_cache.h"
#include "ir/node.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/SmallVector.h>
#include <c10/util/Exception.h>

#include <string>
#include <string_view>
#include <vector>

namespace torch_mgpu::capture {

// Holds warnings back until the call is recorded: a call that raises (and
// runs eagerly instead, which warns again) gives its warnings once.
struct HeldWarnings : c10::WarningHandler {
  std::vector<c10::Warning> held;
  void process(const c10::Warning& w) override { held.push_back(w); }
  void release() {
    for (const auto& w : held) c10::warn(w);
    held.clear();
  }
  // A full run's warnings replace a run's that raised half-way, keeping
  // those only the first gave (a warning given once per process).
  void take_over(HeldWarnings&& full) {
    for (auto& w : held) {
      bool again = false;
      for (const auto& f : full.held) again = again || f.msg() == w.msg();
      if (!again) full.held.push_back(std::move(w));
    }
    held = std::move(full.held);
  }
};

inline bool is_mutated(const c10::Argument& a) { return a.alias_info() && a.alias_info()->isWrite(); }

// Whether the schema takes a Generator or Generator? argument
// (is_generator, arguments.h).
bool has_generator_arg(const c10::FunctionSchema& s);
// A probe's generators: a throwaway one for each (signature.cpp).
void throwaway_generators(const c10::FunctionSchema& schema, torch::jit::Stack& s);
// Whether a call of an op tagged as seeded draws nothing: a dropout
// probability of 0 (op_rules.cpp).
bool draws_nothing(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args);
// Whether an argument is, or holds, an mgpu tensor.
bool holds_mgpu(const c10::IValue& v);

// One call being recorded: its distinct mgpu storages and their Meta twins.
struct Call {
  // A call touches a handful of storages and tensors: these hold them
  // without allocating.
  c10::SmallVector<c10::Storage, 4> storages;  // mgpu storages read or written
  c10::SmallVector<c10::Storage, 4> meta;      // their Meta twins, same size
  // Position of a storage in `storages` (-1 if absent). A call touches a
  // handful of storages: a linear scan beats a hash map and allocates nothing.
  int index_of(const c10::StorageImpl* impl) const {
    for (size_t i = 0; i < storages.size(); ++i)
      if (storages[i].unsafeGetStorageImpl() == impl) return static_cast<int>(i);
    return -1;
  }
  int index_at(const at::Tensor& t) const {
    int i = index_of(t.storage().unsafeGetStorageImpl());
    TORCH_INTERNAL_ASSERT(i >= 0, "mgpu: a storage of the call was not recorded");
    return i;
  }
  c10::SmallVector<at::Tensor, 2> mutated_slots;      // mgpu tensors written by the op
  c10::SmallVector<std::pair<int, int>, 2> mutated_at;  // their (argument, list element or -1)
  c10::SmallVector<at::Tensor, 2> mutated_meta;       // their Meta twins
  int arg = 0, element = -1;  // where to_meta's tensor sits in the call
  c10::SmallVector<const c10::TensorImpl*, 4> seen;  // mgpu tensors met so far, how often, and their twins
  c10::SmallVector<int, 4> seen_count;
  c10::SmallVector<at::Tensor, 4> seen_twins;
  c10::SmallVector<ir::TensorGeometry, 2> seen_geometry;  // their geometries, as the key has them
  // The place of an mgpu tensor met by to_meta in `seen`.
  size_t seen_at(const at::Tensor& t) const {
    for (size_t k = 0; k < seen.size(); ++k)
      if (seen[k] == t.unsafeGetTensorImpl()) return k;
    TORCH_INTERNAL_ASSERT(false, "mgpu: a tensor of the call was not recorded");
  }
  SignatureKey key;
  c10::DeviceIndex device = 0;
  bool cpu_as_meta = false;  // copies take a whole CPU tensor as their source
  // Whether to build Meta twins: only on a cache miss. A hit needs the
  // signature and the storages, not a Meta call (nor Meta allocations).
  bool build_meta = false;
  // Twins on the CPU instead, zero-filled: for ops with no Meta kernel
  // (see infer_without_meta).
  bool cpu_twins = false;
  // Bit i: argument i scales a term (OpInfo::scale_args): a float there
  // keys by its class only.
  uint32_t scale_args = 0;

  int storage_index(const at::Tensor& t) {
    int i = index_of(t.storage().unsafeGetStorageImpl());
    if (i >= 0) return i;
    i = static_cast<int>(storages.size());
    storages.push_back(t.storage());
    if (build_meta)
      meta.push_back((cpu_twins ? at::zeros({static_cast<int64_t>(t.storage().nbytes())}, at::TensorOptions().dtype(at::kByte))
                                : at::empty({static_cast<int64_t>(t.storage().nbytes())},
                                            at::TensorOptions().dtype(at::kByte).device(at::kMeta)))
                         .storage());
    return i;
  }

  // The Meta twin of an argument tensor; records its signature. Without
  // `build_meta`, an undefined tensor: a copy of `t` would cost a reference
  // (for a tensor Python holds, an incref and a decref of its Python object).
  at::Tensor to_meta(const at::Tensor& t, bool mutated) {
    if (!t.defined()) {
      key.add(-1);
      return at::Tensor();
    }
    if (!is_mgpu(t)) {
      key.add(-2);
      key.add_geometry(geometry_of(t));
      key.add(static_cast<int64_t>(t.device().type()));
      // A Python number (wrapped) and a 0-dim tensor of the same dtype
      // promote differently (`int_tensor + 2.5` is float32, `int_tensor +
      // torch.tensor(2.5, dtype=torch.float64)` float64).
      key.add(t.unsafeGetTensorImpl()->is_wrapped_number() ? 1 : 0);
      if (!build_meta) return at::Tensor();
      if (cpu_as_meta) return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
      return t;  // meta kernels accept CPU scalars and refuse the rest, as eager does
    }
    device = t.device().index();
    int i = storage_index(t);
    // The same tensor passed twice (`c[idx] = c`) is one twin: kernels tell
    // it from an equal view (eager refuses an index_put_ from itself).
    int same = -1;
    for (size_t k = 0; k < seen.size(); ++k)
      if (seen[k] == t.unsafeGetTensorImpl()) same = static_cast<int>(k);
    if (same < 0) {
      seen.push_back(t.unsafeGetTensorImpl());
      seen_count.push_back(1);
      geometry_into(t, seen_geometry.emplace_back());  // in place: a geometry is costly to move
    } else {
      ++seen_count[same];
    }
    const auto& g = seen_geometry[same < 0 ? seen.size() - 1 : static_cast<size_t>(same)];
    key.add(i);
    key.add(static_cast<int64_t>(storages[i].nbytes()));
    key.add_geometry(g);
    key.add(same);
    if (mutated) {
      mutated_slots.push_back(t);
      mutated_at.emplace_back(arg, element);
    }
    if (!build_meta) return at::Tensor();
    at::Tensor m;
    if (same >= 0) m = seen_twins[same];
    else m = cpu_twins ? ir::make_view(meta[i], c10::DispatchKey::CPU, g) : meta_view(meta[i], g);
    if (same < 0) seen_twins.push_back(m);
    if (mutated) mutated_meta.push_back(m);
    return m;
  }
};

// Meta arguments for `args`, filling `call` (signature.cpp).
std::vector<c10::IValue> meta_arguments(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                                        Call& call);

// Calls `op` on CPU over made-up arguments (the probe, inference with no
// Meta kernel), moving no generator the program can see. A Generator
// argument is a throwaway one already (throwaway_generators). An op that
// draws from the default CPU generator with no Generator argument draws
// from a throwaway one too, through its overload that takes one (rand ->
// rand.generator); one with no such overload (dropout) draws from the
// default generator, whose state is put back after it (a draw another
// thread makes from it meanwhile is undone).
void call_drawing_nothing(const c10::OperatorHandle& op, torch::jit::Stack& s);

// Meta inference (infer.cpp): the op on Meta twins (or, with no Meta
// kernel, on CPU twins of zeros), its results described.
MetaResult infer(const c10::OperatorHandle& op, std::vector<c10::IValue> margs, Call& call);
bool no_meta_kernel(const c10::Error& e);
MetaResult infer_without_meta(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, bool cpu_as_meta,
                              c10::WarningHandler& warned);

// The CPU probe (probe.cpp): eager's errors and warnings at the call, and
// the CPU kernel's result geometry where Meta's differs. Returns whether
// the CPU kernel ran over the call's own sizes.
bool probe_errors(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, MetaResult& meta,
                  HeldWarnings& warned, bool& cpu_strides, bool& cpu_order);

// Layout corrections (layouts.cpp): where Meta's geometry is not eager's.
bool follows_iterator_layout(const c10::OperatorHandle& op);
void saves_nothing_in_eval(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args, MetaResult& r);
void follow_input_layout(const c10::FunctionSchema& schema, const Call& call, c10::ArrayRef<c10::IValue> args,
                         MetaResult& r, bool results_too);
void make_contiguous(MetaResult& r);
void keep_out_layouts(const c10::FunctionSchema& schema, const Call& call, MetaResult& r);
bool resizes_an_out(const c10::FunctionSchema& schema, const Call& call, const MetaResult& r);

// What the capture hot path asks of an operator, worked out once per
// operator: its name ("aten::add.Tensor"), and the questions above. A call
// looks it up once (prepare_call) and hands it on.
struct OpInfo {
  std::string_view name;
  bool eager = false;          // needs_eager
  bool random = false;         // takes a Generator
  // Tagged nondeterministic_seeded with no Generator argument: it draws
  // from the default generator (unless a dropout probability of 0 says it
  // draws nothing: draws_nothing, per call).
  bool seeded_default = false;
  bool empty_factory = false;
  bool host_indices = false;   // indexing: indices come from the host
  bool host_batch_sizes = false;  // recurrent layers over packed sequences: batch sizes stay on the host
  bool thread_sensitive = false;  // its CPU kernel rounds by its thread count (Node::call_threads)
  bool aten = false;           // an aten op (others may have Python kernels)
  bool makes_quantized = false;  // quantize_per_tensor and friends
  bool batch_norm = false;     // native batch norm: eval mode saves nothing
  bool contiguous_result = false;  // eager allocates its result contiguous, whatever Meta says
  bool contiguous_if_complex = false;  // the same, where its first argument is complex
  bool nansum = false;         // canonical_dims: `dim=[]` means every dim
  bool makes_sparse = false;   // its name says it makes a sparse tensor
  bool makes_nested = false;   // its name says it makes (or reads) a nested tensor
  bool pointwise = false;      // tagged pointwise: reads no matmul precision
  // Bit i: argument i is a Scalar that only scales a term (add's and sub's
  // alpha, addcdiv's and addcmul's value): no result's shape, dtype or
  // error depends on a float's value there, so the signature keys it by
  // its class (0, 1, other), as the node hash does. An optimizer's update
  // (`p.add_(g, alpha=-lr)`, Adam's `addcdiv_(m, d, value=-step_size)`)
  // changes it every step: it would miss the signature cache each step,
  // and run the op's Meta kernel (in Python, for addcdiv_) each time.
  uint32_t scale_args = 0;
  mutable MetaCacheMemo last_signature;  // the cache entry its last call found
  // Per argument: 1 where it is a (optional) ScalarType, 2 a Layout, else 0
  // (refuse_unsupported reads those for quantized and sparse requests).
  std::vector<uint8_t> dtype_or_layout;
};

} // namespace torch_mgpu::capture
