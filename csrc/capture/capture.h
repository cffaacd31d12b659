#pragma once
// The capture stage: a call on mgpu tensors becomes a node of the pending
// graph (Meta inference, the checks eager makes at the call, the node and
// the new versions of what it writes), or is refused. What to do with a call
// (record it, run it eagerly, sync) is the backend layer's (backend/).
#include "capture/borrowed_args.h"
#include "capture/lazy_tensor.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace torch_mgpu::capture {

// What recording asks of an operator, worked out once per operator
// (op_rules.cpp); a call looks it up once, in prepare_call, and hands it on.
struct OpInfo;

// The call's arguments as recording needs them (typed tensor lists, the
// dims a reduction means), and the refusals that need no inference (sparse
// and quantized tensors). Under the state lock. Returns the op's OpInfo.
const OpInfo& prepare_call(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Whether the op always runs eagerly (no Meta kernel, data-dependent output
// shapes, non-tensor results).
bool runs_eagerly(const OpInfo& info);

// Whether the op makes an uninitialized tensor (empty, empty_strided): its
// value is recorded as no value yet, whichever way the call runs.
bool is_empty_factory(const OpInfo& info);

// Whether the op's CPU kernel rounds by its intra-op thread count (batch
// norm's statistics, prod): it runs with the caller's threads.
bool is_thread_sensitive(const OpInfo& info);

// Whether a call of `op` draws from the device's default generator with no
// Generator argument (native_dropout; not attention with a dropout of 0):
// its recording, or its run at the call, seeds it from the mgpu generator.
bool draws_from_default_generator(const OpInfo& info, const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args);

// Whether the op's kernels never read the float32 matmul precision: an
// elementwise op (ATen's `pointwise` tag) or an empty factory multiplies no
// matrices.
bool ignores_matmul_precision(const OpInfo& info);

// Eager's rule: host tensors beside mgpu tensors only as 0-dim scalars.
void check_same_device(const OpInfo& info, const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args);

// Records the call as a node (the results replace the arguments on the
// stack), or raises what eager raises at the call and records nothing.
// `cpu_as_meta` lets whole CPU tensors in (copies from the host). Returns
// whether the node may run on the background worker. `state` is the call's
// settings (ir::current_call_state(), read once per call). `borrowed` (or
// null): the stack's borrowed tensor arguments, released with the arguments.
// Under the state lock.
bool record(const OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack, bool cpu_as_meta,
            const ir::CallState& state, BorrowedArgs* borrowed);

// torch.empty and empty_strided as most calls make them (strided, not
// pinned, a contiguous or given layout, sizes known): their result made
// directly, as no value yet, with neither inference nor a node. Returns
// false, touching nothing, for any other call (record() takes it and raises
// eager's errors). Under the state lock.
bool record_empty(const OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                  const ir::CallState& state);

// Whether this thread is running a call's Meta kernel for record(): a
// Python Meta kernel's out= resize check then warns as ATen does
// (torch_mgpu/_meta_warnings.py), into the call's held warnings.
bool inferring_results();

// Calls of up to this many input elements are checked by running the CPU
// kernel over the call's own sizes and layouts at first sight (their
// results' strides and warnings are then the CPU kernel's); larger ones over
// a copy cut to 2 per dim. 16,384 unless TORCH_MGPU_FULL_PROBE_NUMEL sets it
// (a count of elements, 0 or more; 0 sends every call down the large calls'
// path, as the conformance harness's --large-path does). An invalid value
// raises at the import of torch_mgpu (ir/env.h's check_all).
int64_t full_probe_numel();

} // namespace torch_mgpu::capture
