#pragma once
// The backend: the PrivateUse1 registrations of `mgpu` (hooks, guard,
// allocator, generator, copies) and the kernels every op on mgpu tensors
// reaches. Above engine/ and capture/: it decides what a call does and
// calls down to them; nothing below includes it.
#include "capture/borrowed_args.h"
#include "ir/partition.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>

namespace torch {
class Library;
}

namespace torch_mgpu::capture {
struct OpInfo;  // capture/record_steps.h
}

namespace torch_mgpu::backend {

// The boxed kernel behind every ATen op that reaches PrivateUse1.
void mgpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The same, where `cpu_as_meta` lets whole CPU tensors in (copies from host)
// and `borrowed` (or null) lists the tensor arguments the stack holds
// without references (capture/borrowed_args.h: kernels called unboxed).
void record_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool cpu_as_meta,
                 capture::BorrowedArgs* borrowed = nullptr);

// Registers unboxed kernels for the commonest ops that would reach the
// boxed fallback: the same recording without boxing copies (borrowing.cpp).
void register_borrowing_kernels(torch::Library& lib);

// Whether fallback.cpp takes `op` over with the boxed fallback although
// other backends get a composite kernel: a CompositeExplicitAutograd op
// with CPU and Meta kernels of its own and no PrivateUse1 kernel (mgpu
// records the op CPU runs: one node, and eager's numerics).
bool takes_over_composite(const c10::OperatorHandle& op);

// Runs `op` now on CPU over the materialized inputs (ops with no meta kernel,
// data-dependent output shapes or non-tensor results), rebinding mutated
// inputs and wrapping tensor results as mgpu tensors.
// `borrowed` (or null): the stack's borrowed tensor arguments
// (capture/borrowed_args.h), released with the arguments.
void eager_fallback(const capture::OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                    capture::BorrowedArgs* borrowed = nullptr);
// The same for an op of a trace that runs at its call (engine/at_call.h),
// with one intra-op thread where `one_thread`.
void run_at_call(const capture::OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                 bool one_thread, capture::BorrowedArgs* borrowed = nullptr);

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

// For kernels at the autograd key that send a call below autograd (to be
// recorded as one node) unless a gradient is wanted: grad mode and an
// input that requires grad, or a forward-mode tangent.
inline bool wants_grad(const at::Tensor& t) {
  return t.defined() && ((at::GradMode::is_enabled() && t.requires_grad()) || t._fw_grad(/*level=*/0).defined());
}
// Eager's test for a composite's path, made where eager's composite makes it
// (at the backend key): a gradient wanted or a tensor subclass takes the
// composite; a call that reaches the backend key below autograd with a
// gradient wanted (under `_AutoDispatchBelowAutograd`, from an autograd
// fallback) too.
inline bool takes_composite(const at::Tensor& t) { return wants_grad(t) || at::isTensorSubclassLike(t); }
// The keys below autograd, for the recording kernel.
inline c10::DispatchKeySet below_autograd(c10::DispatchKeySet ks) { return ks & c10::after_ADInplaceOrView_keyset; }

} // namespace torch_mgpu::backend
