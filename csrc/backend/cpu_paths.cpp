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
//
// native_group_norm's gradient: autograd's formula makes the incoming
// gradient and the saved input contiguous in the input's suggested memory
// format on the CPU, contiguous elsewhere, so a channels-last input got a
// contiguous input gradient on mgpu (CPU's is channels-last). Here autograd's
// own kernel runs (its node, its saved values, its double backward); for a
// channels-last input its node gets a post hook that, where the formula took
// the single-backward path (no grad mode, only the input's gradient
// incoming), computes the gradients as the CPU's path does. The formula's
// own result is dropped before anything reads it: the lazy graph never runs
// it.
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
#include <ATen/ops/native_group_norm_backward.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/generated/Functions.h>
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

// Gives NativeGroupNormBackward0's results as the CPU's path computes them
// (see the header comment). Owned by its node: holds it by pointer.
struct GroupNormCpuLayouts final : torch::autograd::FunctionPostHook {
  explicit GroupNormCpuLayouts(torch::autograd::generated::NativeGroupNormBackward0* node) : node_(node) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& grads) override {
    // The double-backward path (grad mode, or gradients of mean and rstd
    // incoming) is composed of the same ops on every device.
    if (at::GradMode::is_enabled() || grads.size() != 3 || !grads[0].defined() || grads[1].defined() ||
        grads[2].defined() || outputs.size() != 3)
      return outputs;
    // The saved values' data (the node's own apply has unpacked and
    // checked them; the hook runs before they are released). Values kept
    // through saved-tensor hooks are not at hand: the formula's stand.
    auto input = node_->input_.get_raw_data(), mean = node_->result1_.get_raw_data(),
         rstd = node_->result2_.get_raw_data(), weight = node_->weight_.get_raw_data();
    if (!input || !mean || !rstd || !weight || !input->defined()) return outputs;
    const auto format = input->suggest_memory_format();
    auto [dx, dgamma, dbeta] = at::native_group_norm_backward_symint(
        grads[0].contiguous(format), input->contiguous(format), *mean, *rstd, *weight, node_->N, node_->C,
        node_->HxW, node_->group,
        {outputs[0].defined(), outputs[1].defined(), outputs[2].defined()});
    return torch::autograd::variable_list{std::move(dx), std::move(dgamma), std::move(dbeta)};
  }

 private:
  torch::autograd::generated::NativeGroupNormBackward0* node_;
};

// Autograd's kernel for native_group_norm (the one every device gets), with
// the hook above on the node of a channels-last input.
void native_group_norm_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  static const c10::SafeKernelFunction autograd_kernel =
      op.getComputedKernelForDispatchKey(c10::DispatchKey::AutogradCPU);
  const at::Tensor input = (*stack)[0].toTensor();
  const bool channels_last = input.defined() && input.suggest_memory_format() != at::MemoryFormat::Contiguous;
  autograd_kernel.callBoxed(op, ks, stack);
  if (!channels_last) return;
  const at::Tensor& out = (*stack)[stack->size() - 3].toTensor();
  auto* node = dynamic_cast<torch::autograd::generated::NativeGroupNormBackward0*>(out.grad_fn().get());
  if (node) node->add_post_hook(std::make_unique<GroupNormCpuLayouts>(node));
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
  m.impl("native_group_norm",
         torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::native_group_norm_autograd>());
}

// Registered by name: a composite kernel counts as PrivateUse1's own, so the
// boxed fallback would not be reached.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("max_pool1d", TORCH_FN(torch_mgpu::backend::max_pool1d));
  // Reached below autograd (inference mode): the same.
  TORCH_MGPU_QUANTILE_KERNELS(m);
  m.impl("one_hot", TORCH_FN(torch_mgpu::backend::one_hot));
}
