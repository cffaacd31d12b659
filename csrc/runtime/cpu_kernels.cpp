// Kernels that PyTorch expects every accelerator backend to have and that
// the CPU backend lacks: the fused LSTM and GRU cells (RNN.cpp sends
// PrivateUse1 inputs to them). Lanes run recorded ops with CPU kernels, so
// they are given here, with the arithmetic of the CUDA kernels.
#include <ATen/ATen.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <torch/library.h>

#include "runtime/executor.h"

namespace torch_mgpu::runtime {
namespace {

at::Tensor add_opt(const at::Tensor& a, const std::optional<at::Tensor>& b) {
  return b && b->defined() ? a + *b : a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  TORCH_CHECK(input_gates.dim() == 2 && input_gates.size(1) % 4 == 0 && input_gates.sizes() == hidden_gates.sizes() &&
                  cx.dim() == 2 && cx.size(1) * 4 == input_gates.size(1),
              "_thnn_fused_lstm_cell: gates must be (batch, 4 * hidden) and cx (batch, hidden)");
  auto gates = add_opt(add_opt(input_gates + hidden_gates, input_bias), hidden_bias);
  auto chunks = gates.chunk(4, 1);
  auto ig = chunks[0].sigmoid(), fg = chunks[1].sigmoid(), cg = chunks[2].tanh(), og = chunks[3].sigmoid();
  auto cy = fg * cx + ig * cg;
  auto hy = og * cy.tanh();
  return {hy, cy, at::cat({ig, fg, cg, og}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward_impl(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy, const at::Tensor& cx,
    const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  bool has_hy = grad_hy && grad_hy->defined(), has_cy = grad_cy && grad_cy->defined();
  if (!has_hy && !has_cy) return {at::Tensor(), at::Tensor(), at::Tensor()};
  TORCH_CHECK(workspace.dim() == 2 && workspace.size(1) == 4 * cy.size(-1), "_thnn_fused_lstm_cell_backward: bad workspace");
  auto w = workspace.chunk(4, 1);
  const auto &ig = w[0], &fg = w[1], &cg = w[2], &og = w[3];
  auto tanh_cy = cy.tanh();
  auto go = has_hy ? *grad_hy : at::zeros_like(cy);
  auto gcx = go * og * (1 - tanh_cy * tanh_cy);
  if (has_cy) gcx = gcx + *grad_cy;
  auto d_og = go * tanh_cy * (1 - og) * og;
  auto d_ig = gcx * cg * (1 - ig) * ig;
  auto d_fg = gcx * cx * (1 - fg) * fg;
  auto d_cg = gcx * ig * (1 - cg * cg);
  auto grad_gates = at::cat({d_ig, d_fg, d_cg, d_og}, 1);
  auto grad_bias = has_bias ? grad_gates.sum(0, /*keepdim=*/false) : at::Tensor();
  return {grad_gates, gcx * fg, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  TORCH_CHECK(input_gates.dim() == 2 && input_gates.size(1) % 3 == 0 && input_gates.sizes() == hidden_gates.sizes() &&
                  hx.dim() == 2 && hx.size(1) * 3 == input_gates.size(1),
              "_thnn_fused_gru_cell: gates must be (batch, 3 * hidden) and hx (batch, hidden)");
  auto in = add_opt(input_gates, input_bias).chunk(3, 1);
  auto hid = add_opt(hidden_gates, hidden_bias).chunk(3, 1);
  auto rg = (in[0] + hid[0]).sigmoid();
  auto ig = (in[1] + hid[1]).sigmoid();
  auto ng = (in[2] + rg * hid[2]).tanh();
  auto hy = ng + ig * (hx - ng);
  return {hy, at::cat({rg, ig, ng, hx, hid[2]}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  TORCH_CHECK(workspace.dim() == 2 && workspace.size(1) == 5 * grad_hy.size(-1), "_thnn_fused_gru_cell_backward: bad workspace");
  auto w = workspace.chunk(5, 1);
  const auto &rg = w[0], &ig = w[1], &ng = w[2], &hx = w[3], &hn = w[4];
  const auto& go = grad_hy;
  auto gig = go * (hx - ng) * (1 - ig) * ig;
  auto ghx = go * ig;
  auto gin = go * (1 - ig) * (1 - ng * ng);
  auto ghn = gin * rg;
  auto grg = gin * hn * (1 - rg) * rg;
  auto grad_input_gates = at::cat({grg, gig, gin}, 1);
  auto grad_hidden_gates = at::cat({grg, gig, ghn}, 1);
  at::Tensor gib, ghb;
  if (has_bias) {
    gib = grad_input_gates.sum(0);
    ghb = grad_hidden_gates.sum(0);
  }
  return {grad_input_gates, grad_hidden_gates, ghx, gib, ghb};
}

// scaled_dot_product_attention asks a per-device stub which fused kernel to
// use, and takes the math path on devices with none. mgpu runs CPU kernels,
// so it makes CPU's choice (a function of metadata only): the recorded op is
// the one eager CPU runs, and results match it bitwise.
int64_t sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool enable_gqa) {
  // CPU tensors with the same metadata and no bytes: the choice reads
  // sizes, strides, dtypes and requires_grad, never data.
  auto shadow = [](const at::Tensor& t) {
    auto s = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(allocate(0)), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                      t.dtype());
    s.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    s.unsafeGetTensorImpl()->set_requires_grad(t.requires_grad());
    return s;
  };
  // Tracing with symbolic sizes (torch.compile, dynamic shapes): the math
  // path, which any size can take.
  for (const at::Tensor* t : {&q, &k, &v, mask && mask->defined() ? &*mask : nullptr})
    if (t && t->unsafeGetTensorImpl()->has_symbolic_sizes_strides())
      return static_cast<int64_t>(sdp::SDPBackend::math);
  std::optional<at::Tensor> m;
  if (mask && mask->defined()) m = shadow(*mask);
  // The shadows are plain CPU tensors: no Python mode (a FakeTensorMode
  // tracing the call) may see them.
  c10::impl::ExcludeDispatchKeyGuard no_python(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  return at::_fused_sdp_choice(shadow(q), shadow(k), shadow(v), m, dropout_p, is_causal, scale, enable_gqa);
}

} // namespace
} // namespace torch_mgpu::runtime

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torch_mgpu::runtime::sdp_choice)
} // namespace at::native

TORCH_LIBRARY_IMPL(aten, CPU, m) {
  using namespace torch_mgpu::runtime;
  m.impl("_thnn_fused_lstm_cell", TORCH_FN(fused_lstm_cell));
  m.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(fused_lstm_cell_backward_impl));
  m.impl("_thnn_fused_gru_cell", TORCH_FN(fused_gru_cell));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(fused_gru_cell_backward));
}
