#pragma once
// The capture stage's entry points, shared by the fallback, copy and sync.
#include "capture/lazy_tensor.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace torch_mgpu::ir {
struct Partition;
}

namespace torch_mgpu::capture {

// The boxed kernel behind every ATen op that reaches PrivateUse1.
void mgpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The same, where `cpu_as_meta` lets whole CPU tensors in (copies from host).
void record_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool cpu_as_meta);

// Eager's rule: host tensors beside mgpu tensors only as 0-dim scalars.
void check_same_device(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args);

// Runs `op` now on CPU over the materialized inputs (ops with no meta kernel,
// data-dependent output shapes or non-tensor results), rebinding mutated
// inputs and wrapping tensor results as mgpu tensors.
void eager_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Computes every pending value (the sync point). Raises the first error an
// op raised during execution, after binding everything that did compute.
void sync_all();
// The materialized CPU bytes of an mgpu storage (syncs if pending).
c10::Storage materialize(const c10::Storage& mgpu_storage);

// Records (on mgpu inputs) or runs (on CPU / CUDA inputs) a compiled
// partition: the op torch_mgpu::partition.
std::vector<at::Tensor> call_partition(const c10::intrusive_ptr<ir::Partition>& p, at::TensorList inputs);
// An mgpu tensor over the bytes of a CPU or CUDA tensor, with no copy. The
// value is read as it is when the graph runs: the caller must compute what
// reads it before the bytes change (the compiled backend syncs before it
// returns to the caller).
at::Tensor alias_tensor(const at::Tensor& t);
// The computed value of an mgpu tensor as a tensor on `device` (CPU or
// CUDA), sharing the value's bytes where they already lie there (syncs).
at::Tensor value_view(const at::Tensor& t, c10::Device device);

// Background execution: once `async_ops()` ops have been recorded since the
// last flush, the pending graph starts running on a background worker while
// capture goes on (0: never). Called after each recorded op.
void recorded(bool background_safe);
int64_t async_ops();
void set_async_ops(int64_t n);

// The graph-size limit that triggers an automatic sync.
int64_t max_pending_ops();
void set_max_pending_ops(int64_t n);

} // namespace torch_mgpu::capture
