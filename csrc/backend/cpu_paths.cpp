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
#include <ATen/ops/max_pool1d_compositeimplicitautograd_dispatch.h>
#include <torch/library.h>

namespace torch_mgpu::backend {
namespace {

at::Tensor max_pool1d(c10::DispatchKeySet ks, const at::Tensor& self, at::IntArrayRef kernel_size,
                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  if (wants_grad(self) || at::isTensorSubclassLike(self))
    return at::compositeimplicitautograd::max_pool1d(self, kernel_size, stride, padding, dilation, ceil_mode);
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::redispatch::max_pool1d(below_autograd(ks), self, kernel_size, stride, padding, dilation, ceil_mode);
}

} // namespace
} // namespace torch_mgpu::backend

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("max_pool1d", TORCH_FN(torch_mgpu::backend::max_pool1d));
}

// Below autograd the op is recorded whole (the boxed kernel every op
// reaches; registered by name, since a composite kernel counts as
// PrivateUse1's own).
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("max_pool1d", torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::mgpu_fallback>());
}
