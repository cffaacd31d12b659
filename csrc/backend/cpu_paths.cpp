// Composite ops whose kernel takes one path on the CPU and another on any
// other device, where the two give results laid out differently. mgpu
// computes what eager CPU computes, layout included: these take the CPU's
// path.
//
// max_pool1d: on the CPU, when no gradient is wanted, a kernel of its own
// that allocates the result contiguous; elsewhere (and with a gradient)
// max_pool1d_with_indices, through max_pool2d's, whose result follows a
// channels-last input's layout (`x.transpose(1, 2).contiguous()
// .transpose(1, 2)`). Here, as in eager: with a gradient wanted the
// composite runs (its views carry it); otherwise max_pool1d itself is
// recorded, one node whose result is contiguous (capture's OpInfo), run by
// the lane's own max_pool1d (the CPU's path on CPU lanes; on CUDA lanes the
// values are moved into the recorded layout).
#include "backend/backend.h"

#include <ATen/RedispatchFunctions.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/stack.h>
#include <ATen/ops/max_pool1d_compositeimplicitautograd_dispatch.h>
#include <torch/library.h>

namespace torch_mgpu::backend {
namespace {

// Eager's test, made where eager's composite makes it (at the backend key):
// a call that reaches it below autograd with a gradient wanted (under
// `_AutoDispatchBelowAutograd`, from an autograd fallback) takes the
// composite too.
bool takes_composite(const at::Tensor& self) { return wants_grad(self) || at::isTensorSubclassLike(self); }

at::Tensor max_pool1d_autograd(c10::DispatchKeySet ks, const at::Tensor& self, at::IntArrayRef kernel_size,
                               at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                               bool ceil_mode) {
  if (takes_composite(self))
    return at::compositeimplicitautograd::max_pool1d(self, kernel_size, stride, padding, dilation, ceil_mode);
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::redispatch::max_pool1d(below_autograd(ks), self, kernel_size, stride, padding, dilation, ceil_mode);
}

// Below autograd: the composite where eager's test says so, else the op
// recorded whole (through the boxed kernel every op reaches).
at::Tensor max_pool1d(const at::Tensor& self, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  if (takes_composite(self))
    return at::compositeimplicitautograd::max_pool1d(self, kernel_size, stride, padding, dilation, ceil_mode);
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::max_pool1d", "");
  torch::jit::Stack stack;
  torch::jit::push(stack, self, kernel_size, stride, padding, dilation, ceil_mode);
  mgpu_fallback(op, &stack);
  return torch::jit::pop(stack).toTensor();
}

} // namespace
} // namespace torch_mgpu::backend

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("max_pool1d", TORCH_FN(torch_mgpu::backend::max_pool1d_autograd));
}

// Registered by name: a composite kernel counts as PrivateUse1's own, so the
// boxed fallback would not be reached.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("max_pool1d", TORCH_FN(torch_mgpu::backend::max_pool1d));
}
