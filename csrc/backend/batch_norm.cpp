// native_batch_norm writes the running statistics it is given (training
// mode), yet its schema declares no write: recorded as it is, the IR would
// not know that running_mean and running_var change. The update then ran
// only while the output was held (a forward whose output is dropped, as
// torch.optim.swa_utils.update_bn does, updated nothing), a read of the
// statistics recorded after it could run before it on another lane, and on
// CUDA lanes the kernel wrote a device copy that the host never saw.
// _native_batch_norm_legit takes the same arguments, runs the same kernels
// on CPU and CUDA, and declares both writes: native_batch_norm (and its out=
// form) with both statistics in training mode is recorded as that op.
#include "backend/backend.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace torch_mgpu::backend {
namespace {

void native_batch_norm(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // (input, weight, bias, running_mean, running_var, training, momentum, eps)
  const size_t n = op.schema().arguments().size();
  const auto args = torch::jit::last(*stack, n);
  const bool updates = args[5].toBool() && args[3].isTensor() && args[3].toTensor().defined() &&
      args[4].isTensor() && args[4].toTensor().defined();
  if (!updates) return mgpu_fallback(op, stack);
  // native_batch_norm.out takes the outputs after the same arguments, as
  // _native_batch_norm_legit.out does.
  const bool out = op.schema().overload_name() == "out";
  static const auto legit = c10::Dispatcher::singleton().findSchemaOrThrow("aten::_native_batch_norm_legit", "");
  static const auto legit_out =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::_native_batch_norm_legit", "out");
  (out ? legit_out : legit).callBoxed(stack);
}

} // namespace
} // namespace torch_mgpu::backend

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"native_batch_norm", "native_batch_norm.out"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::native_batch_norm>());
}
