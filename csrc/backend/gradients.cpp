// Autograd's own kernels (the ones every device gets, its formulas and
// nodes), with what mgpu adds around them:
//
// native_group_norm: autograd's formula makes the incoming gradient and the
// saved input contiguous in the input's suggested memory format on the CPU,
// contiguous elsewhere, so a channels-last input got a contiguous input
// gradient on mgpu (CPU's is channels-last). For a channels-last input the
// node gets a post hook that, where the formula took the single-backward
// path (no grad mode, only the input's gradient incoming), computes the
// gradients as the CPU's path does. The formula's own result is dropped
// before anything reads it: the lazy graph never runs it.
//
// Sparse gradients (gather's sparse_grad=True; embedding's and
// embedding_bag's sparse=True, nn.Embedding(sparse=True)): the gradient is a
// sparse COO tensor, and mgpu has no sparse tensors; the backward failed at
// `backward()`, far from the call. Where a gradient is wanted the call is
// refused, naming the way out; without one the flag changes nothing and the
// call is recorded.
#include "backend/backend.h"

#include <ATen/ops/native_group_norm_backward.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/library.h>

namespace torch_mgpu::backend {
namespace {

// Autograd's kernel for `op` (registered for every device through the
// Autograd alias; here taken from the CPU's entry, the same function). Each
// caller keeps it in a static: the lookup allocates.
c10::SafeKernelFunction autograd_kernel(const c10::OperatorHandle& op) {
  return op.getComputedKernelForDispatchKey(c10::DispatchKey::AutogradCPU);
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

// Autograd's kernel, with the hook above on the node of a channels-last input.
void native_group_norm(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const at::Tensor input = (*stack)[0].toTensor();
  const bool channels_last = input.defined() && input.suggest_memory_format() != at::MemoryFormat::Contiguous;
  static const c10::SafeKernelFunction kernel = autograd_kernel(op);
  kernel.callBoxed(op, ks, stack);
  if (!channels_last) return;
  const at::Tensor& out = (*stack)[stack->size() - 3].toTensor();
  auto* node = dynamic_cast<torch::autograd::generated::NativeGroupNormBackward0*>(out.grad_fn().get());
  if (node) node->add_post_hook(std::make_unique<GroupNormCpuLayouts>(node));
}

// Ops whose bool argument Op::flag makes their first argument's gradient
// sparse: refused where that gradient would be made. One instance per op
// (its argument's place and autograd's kernel are kept).
template <typename Op>
void dense_gradients_only(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  static const size_t at = *schema.argumentIndexWithName(Op::flag);
  const auto args = torch::jit::last(*stack, schema.arguments().size());
  const bool sparse = args[at].isBool() && args[at].toBool();
  static const std::string name = schema.name().substr(schema.name().find_first_not_of('_', 6));  // aten::_x: x
  TORCH_CHECK_NOT_IMPLEMENTED(!sparse || !wants_grad(args[0].toTensor()), "mgpu: ", name, "(..., ",
                              Op::flag, "=True) makes a sparse gradient, and mgpu has no sparse tensors: use ",
                              Op::flag, "=False (the same gradient, dense), or run it on the CPU");
  static const c10::SafeKernelFunction kernel = autograd_kernel(op);
  kernel.callBoxed(op, ks, stack);
}

struct Gather {
  static constexpr const char* flag = "sparse_grad";
};
struct Embedding {
  static constexpr const char* flag = "sparse";
};
struct EmbeddingBag {
  static constexpr const char* flag = "sparse";
};

} // namespace
} // namespace torch_mgpu::backend

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("native_group_norm", torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::native_group_norm>());
  namespace b = torch_mgpu::backend;
  m.impl("gather", torch::CppFunction::makeFromBoxedFunction<&b::dense_gradients_only<b::Gather>>());
  m.impl("embedding", torch::CppFunction::makeFromBoxedFunction<&b::dense_gradients_only<b::Embedding>>());
  m.impl("_embedding_bag", torch::CppFunction::makeFromBoxedFunction<&b::dense_gradients_only<b::EmbeddingBag>>());
}
