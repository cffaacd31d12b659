// The boxed kernel behind every op on mgpu tensors: what a call does, by
// policy (run what is pending when the call's settings differ from theirs,
// run eagerly what cannot be recorded, sync when the graph grows too large
// or TORCH_MGPU_SYNC=op asks, else start a background flight when due), and
// the registrations that send ops to it.
#include "ir/env.h"
#include "ir/errors.h"
#include "backend/backend.h"
#include "capture/arguments.h"
#include "capture/borrowed_args.h"
#include "capture/capture.h"
#include "engine/at_call.h"
#include "engine/engine.h"
#include "ir/call_state.h"

#include <torch/library.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace torch_mgpu::backend {

void mgpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  record_call(op, stack, false, nullptr);
}

namespace {
// TORCH_MGPU_SYNC=op runs every op at its call, as CUDA_LAUNCH_BLOCKING=1
// does for CUDA: an error that depends on data is raised by the call that
// caused it (for debugging: it gives up all parallelism).
bool sync_each_op() {
  static const bool on = ir::env::choice(ir::env::Var::Sync) == "op";
  return on;
}

// Whether any tensor of the call's arguments passes `test`.
template <class F>
bool any_tensor(const c10::OperatorHandle& op, const torch::jit::Stack& stack, F&& test) {
  bool found = false;
  for (const auto& v : torch::jit::last(stack, op.schema().arguments().size()))
    capture::for_each_tensor(v, [&](const at::Tensor& t) { found = found || test(t); });
  return found;
}

// Whether the call has a tensor that is not an mgpu one (a copy from the
// host's source).
bool has_host_tensor(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  return any_tensor(op, stack, [](const at::Tensor& t) { return t.defined() && !capture::is_mgpu(t); });
}

// Whether the call has an mgpu tensor over a storage mgpu did not make (a
// wrapper subclass's, under no_dispatch): it cannot run eagerly either.
bool has_foreign_storage(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  return any_tensor(op, stack, [](const at::Tensor& t) {
    return capture::is_mgpu(t) && t.has_storage() && !capture::is_lazy_storage(t.storage());
  });
}

// The settings the pending ops were called with (guarded by the state lock).
ir::CallState& pending_state() {
  static ir::CallState s;
  return s;
}
} // namespace

void record_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool cpu_as_meta,
                 capture::BorrowedArgs* borrowed) {
  capture::StateLock lock;
  const capture::OpInfo& info = capture::prepare_call(op, stack);
  // Counted into the program's trace, which runs lazily or at its calls.
  const auto way =
      engine::at_call::on_call(&op.schema(), torch::jit::last(*stack, op.schema().arguments().size()));
  const bool sync_now = sync_each_op();
  // A graph runs under one set of settings, those its ops were called with:
  // where the program changed them (torch.set_default_dtype, ...) with ops
  // pending, those run first, under their own settings.
  // An elementwise op reads no matmul precision: the pending ops' stands for
  // it, so that changing the precision between two of them runs nothing.
  const bool reads_precision = !capture::ignores_matmul_precision(info);
  ir::CallState state = ir::current_call_state(reads_precision);
  if (!reads_precision) state.matmul_precision = pending_state().matmul_precision;
  if (state != pending_state()) {
    if (ir::pending_op_count() > 0) engine::sync_all();
    pending_state() = state;
  }
  if (capture::runs_eagerly(info)) {
    engine::at_call::ProgramRead read;  // it reads values: the trace ends with it
    eager_fallback(info, op, stack, borrowed);
    return;
  }
  // At the call: the CPU kernel now, as eager runs it. Not an empty
  // factory (recorded as no value yet, as a copy into it expects), a copy
  // from the host (eager's device check would refuse its host tensor: it is
  // recorded), nor bytes mgpu did not make (they cannot run eagerly). An op
  // whose kernel rounds by its thread count keeps the caller's threads.
  if (way != engine::at_call::Way::Lazy && !capture::is_empty_factory(info) &&
      !(cpu_as_meta && has_host_tensor(op, *stack)) && !has_foreign_storage(op, *stack)) {
    run_at_call(info, op, stack, way == engine::at_call::Way::AtCallOneThread && !capture::is_thread_sensitive(info),
                borrowed);
    return;
  }
  if (!cpu_as_meta) capture::check_same_device(info, op, torch::jit::last(*stack, op.schema().arguments().size()));
  // torch.empty: no value yet, nothing to record.
  if (capture::record_empty(info, op, stack, state)) return;
  bool background_safe = false;
  try {
    background_safe = capture::record(info, op, stack, cpu_as_meta, state, borrowed);
  } catch (const std::exception& e) {
    if (borrowed) borrowed->own();
    // A SIGINT that Python code under the call (a Meta kernel written in
    // Python) took as KeyboardInterrupt stops the program: no eager rerun.
    ir::rethrow_if_interrupt(e);
    capture::error_handled(e);  // a Python kernel's error is no longer pending
    // No Meta kernel, or the Meta kernel refused the call: run it now on
    // CPU, which either computes it or raises exactly eager's error. Over a
    // storage mgpu did not make it cannot: the recording's error is the call's.
    if (has_foreign_storage(op, *stack)) throw;
    eager_fallback(info, op, stack);
    return;
  }
  if (sync_now || ir::pending_op_count() > engine::max_pending_ops()) engine::sync_all();
  else engine::recorded(background_safe);
}

bool takes_over_composite(const c10::OperatorHandle& op) {
  using K = c10::DispatchKey;
  return (op.hasKernelForDispatchKey(K::CompositeExplicitAutograd) ||
          op.hasKernelForDispatchKey(K::CompositeExplicitAutogradNonFunctional)) &&
         op.hasKernelForDispatchKey(K::CPU) && op.hasKernelForDispatchKey(K::Meta) &&
         !op.hasKernelForDispatchKey(K::PrivateUse1);
}

namespace {

// Ops that other backends get from a composite kernel while CPU has its own
// (functional ops as empty + resize_ + out=; native_layer_norm as batch
// norm) are taken over here when they have CPU and Meta kernels, so that
// mgpu records the op CPU runs: one node, and eager's numerics.
struct DirectKernels {
  std::unique_ptr<torch::Library> lib;
  DirectKernels() {
    auto& d = c10::Dispatcher::singleton();
    lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                           __FILE__, __LINE__);
    // The commonest ops first, as unboxed kernels (borrowing.cpp): the
    // loop below then leaves them alone.
    register_borrowing_kernels(*lib);
    std::vector<c10::OperatorName> names;
    for (auto key : {c10::DispatchKey::CompositeExplicitAutogradNonFunctional,
                     c10::DispatchKey::CompositeExplicitAutograd})
      for (auto& n : d.getAllOpNamesForDispatchKey(key)) names.push_back(n);
    for (const auto& name : names) {
      if (name.name.rfind("aten::", 0) != 0 || name.name == "aten::copy_") continue;
      auto op = d.findOp(name);
      if (!op || !takes_over_composite(*op)) continue;
      std::string full = name.name.substr(6);
      if (!name.overload_name.empty()) full += "." + name.overload_name;
      lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&mgpu_fallback>());
    }
    // Composite kernels that send unknown backends to an "_overrideable" op
    // that only raises: record the op itself and run CPU's kernel.
    // mode's out= variant is composite, and refuses devices other than
    // CPU, CUDA and XPU by name: record mode.values itself (CPU has it).
    // conj_physical_ (complex tensors) has only a composite kernel, which
    // calls the device's own DispatchStub: there is none for mgpu; record it
    // (Meta has it), and the lanes run the composite on their devices.
    // ldexp's composite runs CPU's ldexp kernel (a DispatchStub) on CPU
    // tensors and self * 2 ** other on any other device: in float32
    // ldexp(1e-30, 130) is inf that way, and a bool exponent, which CPU's
    // kernel refuses, is taken. Recorded as ldexp, it runs CPU's kernel.
    // kaiser_window's composite calls the device's DispatchStub (none for
    // mgpu: an internal assert): recorded, the lanes run CPU's kernel.
    // mish_backward and native_channel_shuffle have CPU kernels of their own
    // and a composite for other devices: mish_backward's composite rounds
    // between its steps (a last-place difference in bfloat16), and
    // native_channel_shuffle's returns a contiguous result where the CPU's
    // keeps a channels-last input's layout. Recorded, the lanes run CPU's.
    for (const char* name : {"convolution", "convolution_backward", "mode.values", "conj_physical_", "ldexp.Tensor",
                             "ldexp.out", "ldexp_", "kaiser_window", "kaiser_window.periodic", "kaiser_window.beta",
                             "mish_backward", "native_channel_shuffle"})
      lib->impl(name, torch::CppFunction::makeFromBoxedFunction<&mgpu_fallback>());
  }
};
DirectKernels g_direct_kernels;

} // namespace
} // namespace torch_mgpu::backend

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::mgpu_fallback>());
}

// A factory asked for a sparse, nested or quantized mgpu tensor (`sparse_coo_tensor(
// ..., device="mgpu")`, `_empty_affine_quantized`) reaches these keys: the
// same clear refusal as an op on one.
namespace torch_mgpu::backend {
namespace {
void refuse_sparse(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "mgpu: sparse tensors are not supported (", op.schema().name(),
                              "); use them on the CPU: x.cpu()");
}
void refuse_nested(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "mgpu: nested tensors are not supported (", op.schema().name(),
                              "); use them on the CPU: x.cpu()");
}
void refuse_quantized(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "mgpu: quantized tensors are not supported (", op.schema().name(),
                              "); quantize on the CPU: x.cpu()");
}
} // namespace
} // namespace torch_mgpu::backend

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::refuse_sparse>());
}
TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::refuse_sparse>());
}
TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::refuse_nested>());
}
TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::refuse_quantized>());
}
