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
//
// quantile / nanquantile with a tensor q: the composite checks that every q
// is in [0, 1] only on the CPU (elsewhere it would wait for the device); on
// mgpu a q outside took silently wrong values (nanquantile) or raised
// gather's index error at the next sync. Here, as on the CPU: the composite's
// own checks first, in its order (run on meta copies of the arguments, which
// skip the range check and compute nothing), then the range check (it reads
// q, a sync of q's pending work), then the composite on mgpu.
//
// one_hot: the composite checks the class values (non-negative, below
// num_classes) only on the CPU; elsewhere it leaves them to scatter's
// index check (on mgpu: another error, at the next sync) and refuses a
// num_classes below 1 in words of its own. Here the CPU's checks, in its
// order (they read the smallest and largest class, a sync, as on the CPU),
// then the composite.
#include "backend/backend.h"

#include <ATen/RedispatchFunctions.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/stack.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/max_pool1d_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/nanquantile_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/one_hot_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/quantile_compositeimplicitautograd_dispatch.h>
#include <torch/library.h>

namespace torch_mgpu::backend {
namespace {

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

at::Tensor meta_like(const at::Tensor& t) {
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

bool all_on(const at::Tensor& t, std::initializer_list<const at::Tensor*> others) {
  for (const at::Tensor* other : others)
    if (other->device() != t.device())
      return false;
  return true;
}

// Raises what eager CPU raises for a q outside [0, 1]. `structure` runs the
// composite on meta tensors standing for its arguments and gives the
// result's sizes (not run where the arguments are on different devices:
// the composite itself then names that); `out`, where given, is resized to them first, as the
// CPU's composite resizes it before it checks the range.
template <typename Structure>
void check_quantile_range(const at::Tensor& q, at::Tensor* out, bool same_devices, Structure structure) {
  if (!same_devices)
    return;
  const at::Tensor result = structure();
  if (q.ge(0).logical_and_(q.le(1)).all().item<bool>())
    return;
  if (out != nullptr)
    at::native::resize_output(*out, result.sizes());
  TORCH_CHECK(false, "quantile() q values must be in the range [0, 1]");
}

template <bool Nan>
at::Tensor quantile_tensor_q(const at::Tensor& self, const at::Tensor& q, std::optional<int64_t> dim, bool keepdim,
                             c10::string_view interpolation) {
  using Tensorwise = at::Tensor (*)(const at::Tensor&, const at::Tensor&, std::optional<int64_t>, bool, c10::string_view);
  const Tensorwise run = Nan ? Tensorwise{&at::compositeimplicitautograd::nanquantile}
                             : Tensorwise{&at::compositeimplicitautograd::quantile};
  check_quantile_range(q, nullptr, all_on(self, {&q}),
                       [&] { return run(meta_like(self), meta_like(q), dim, keepdim, interpolation); });
  return run(self, q, dim, keepdim, interpolation);
}

template <bool Nan>
at::Tensor& quantile_tensor_q_out(const at::Tensor& self, const at::Tensor& q, std::optional<int64_t> dim,
                                  bool keepdim, c10::string_view interpolation, at::Tensor& out) {
  using Outwise = at::Tensor& (*)(const at::Tensor&, const at::Tensor&, std::optional<int64_t>, bool,
                                  c10::string_view, at::Tensor&);
  const Outwise run = Nan ? Outwise{&at::compositeimplicitautograd::nanquantile_outf}
                          : Outwise{&at::compositeimplicitautograd::quantile_outf};
  check_quantile_range(q, &out, all_on(self, {&q, &out}), [&] {
    at::Tensor meta_out = meta_like(out);
    return run(meta_like(self), meta_like(q), dim, keepdim, interpolation, meta_out);
  });
  return run(self, q, dim, keepdim, interpolation, out);
}

at::Tensor one_hot(const at::Tensor& self, int64_t num_classes) {
  if (self.scalar_type() == at::kLong && self.numel() > 0 && !at::isTensorSubclassLike(self)) {
    const auto [smallest, largest] = at::aminmax(self);
    TORCH_CHECK(smallest.item<int64_t>() >= 0, "Class values must be non-negative.");
    if (num_classes != -1)
      TORCH_CHECK(num_classes > largest.item<int64_t>(), "Class values must be smaller than num_classes.");
  }
  return at::compositeimplicitautograd::one_hot(self, num_classes);
}

} // namespace
} // namespace torch_mgpu::backend

#define TORCH_MGPU_QUANTILE_KERNELS(m)                                                            \
  m.impl("quantile", TORCH_FN(torch_mgpu::backend::quantile_tensor_q<false>));                   \
  m.impl("quantile.out", TORCH_FN(torch_mgpu::backend::quantile_tensor_q_out<false>));           \
  m.impl("nanquantile", TORCH_FN(torch_mgpu::backend::quantile_tensor_q<true>));                 \
  m.impl("nanquantile.out", TORCH_FN(torch_mgpu::backend::quantile_tensor_q_out<true>))

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("max_pool1d", TORCH_FN(torch_mgpu::backend::max_pool1d_autograd));
  // The composite, with its gradient, after the CPU's range check.
  TORCH_MGPU_QUANTILE_KERNELS(m);
  m.impl("one_hot", TORCH_FN(torch_mgpu::backend::one_hot));
}

// Registered by name: a composite kernel counts as PrivateUse1's own, so the
// boxed fallback would not be reached.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("max_pool1d", TORCH_FN(torch_mgpu::backend::max_pool1d));
  // Reached below autograd (inference mode): the same.
  TORCH_MGPU_QUANTILE_KERNELS(m);
  m.impl("one_hot", TORCH_FN(torch_mgpu::backend::one_hot));
}
