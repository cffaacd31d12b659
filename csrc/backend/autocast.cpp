// Autocast on mgpu: torch.autocast("mgpu", dtype=torch.bfloat16 or
// torch.float16) casts the ops CPU autocast casts, by the same policies and
// with the same casts (ATen's cached_cast), so results and their dtypes are
// CPU autocast's. The casts are recorded like any op.
//
// The lists follow PyTorch's AutocastCPU registrations. They change between
// PyTorch releases (an op is added, a deprecated one removed), so the kernel
// is boxed and registered for each listed op that this torch defines; a test
// compares the two sets of registered ops on the installed torch.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>

namespace torch_mgpu::backend {
namespace {

enum class Policy { LowerPrecision, Fp32, Promote };

// Matrix products and convolutions: run in the autocast dtype.
#define MGPU_AUTOCAST_LOWER_PRECISION(_) \
  _(conv1d)                              \
  _(conv1d, padding)                     \
  _(conv2d)                              \
  _(conv2d, padding)                     \
  _(conv3d)                              \
  _(conv3d, padding)                     \
  _(bmm)                                 \
  _(mm)                                  \
  _(linalg_vecdot)                       \
  _(baddbmm)                             \
  _(addmm)                               \
  _(_addmm_activation)                   \
  _(addbmm)                              \
  _(linear)                              \
  _(_convolution, deprecated)            \
  _(matmul)                              \
  _(conv_tbc)                            \
  _(mkldnn_rnn_layer)                    \
  _(conv_transpose1d)                    \
  _(conv_transpose2d, input)             \
  _(conv_transpose3d, input)             \
  _(prelu)                               \
  _(scaled_dot_product_attention)        \
  _(_native_multi_head_attention)

// Ops whose accuracy needs float32: their inputs are cast up.
#define MGPU_AUTOCAST_FP32(_)              \
  _(avg_pool3d)                            \
  _(binary_cross_entropy)                  \
  _(grid_sampler)                          \
  _(polar)                                 \
  _(prod)                                  \
  _(prod, dim_int)                         \
  _(quantile)                              \
  _(quantile, scalar)                      \
  _(nanquantile)                           \
  _(nanquantile, scalar)                   \
  _(stft)                                  \
  _(stft, center)                          \
  _(cdist)                                 \
  _(grid_sampler_2d)                       \
  _(_grid_sampler_2d_cpu_fallback)         \
  _(grid_sampler_3d)                       \
  _(trace)                                 \
  _(view_as_complex)                       \
  _(cholesky)                              \
  _(cholesky_inverse)                      \
  _(cholesky_solve)                        \
  _(inverse)                               \
  _(lu_solve)                              \
  _(orgqr)                                 \
  _(ormqr)                                 \
  _(pinverse)                              \
  _(max_pool3d)                            \
  _(max_unpool2d)                          \
  _(max_unpool3d)                          \
  _(adaptive_avg_pool3d)                   \
  _(reflection_pad1d)                      \
  _(reflection_pad2d)                      \
  _(replication_pad1d)                     \
  _(replication_pad2d)                     \
  _(replication_pad3d)                     \
  _(mse_loss)                              \
  _(cosine_embedding_loss)                 \
  _(nll_loss)                              \
  _(nll_loss2d)                            \
  _(hinge_embedding_loss)                  \
  _(poisson_nll_loss)                      \
  _(smooth_l1_loss)                        \
  _(cross_entropy_loss)                    \
  _(l1_loss)                               \
  _(huber_loss)                            \
  _(margin_ranking_loss)                   \
  _(soft_margin_loss)                      \
  _(triplet_margin_loss)                   \
  _(multi_margin_loss)                     \
  _(ctc_loss, IntList)                     \
  _(ctc_loss, Tensor)                      \
  _(kl_div)                                \
  _(multilabel_margin_loss)                \
  _(binary_cross_entropy_with_logits)      \
  _(fft_fft)                               \
  _(fft_ifft)                              \
  _(fft_fft2)                              \
  _(fft_ifft2)                             \
  _(fft_fftn)                              \
  _(fft_ifftn)                             \
  _(fft_rfft)                              \
  _(fft_irfft)                             \
  _(fft_rfft2)                             \
  _(fft_irfft2)                            \
  _(fft_rfftn)                             \
  _(fft_irfftn)                            \
  _(fft_hfft)                              \
  _(fft_ihfft)                             \
  _(linalg_cond)                           \
  _(linalg_cond, p_str)                    \
  _(linalg_matrix_rank)                    \
  _(linalg_matrix_rank, tol_tensor)        \
  _(linalg_matrix_rank, atol_rtol_tensor)  \
  _(linalg_matrix_rank, atol_rtol_float)   \
  _(linalg_solve)                          \
  _(linalg_cholesky)                       \
  _(linalg_svdvals)                        \
  _(linalg_eigvals)                        \
  _(linalg_eigvalsh)                       \
  _(linalg_inv)                            \
  _(linalg_householder_product)            \
  _(linalg_tensorinv)                      \
  _(linalg_tensorsolve)                    \
  _(fake_quantize_per_tensor_affine)       \
  _(geqrf)                                 \
  _(_lu_with_info)                         \
  _(qr)                                    \
  _(svd)                                   \
  _(triangular_solve)                      \
  _(fractional_max_pool2d)                 \
  _(fractional_max_pool3d)                 \
  _(adaptive_max_pool3d)                   \
  _(multilabel_margin_loss_forward)        \
  _(linalg_qr)                             \
  _(linalg_cholesky_ex)                    \
  _(linalg_svd)                            \
  _(linalg_eig)                            \
  _(linalg_eigh)                           \
  _(linalg_lstsq)                          \
  _(linalg_inv_ex)

// Ops over several tensors: run in their widest floating dtype.
#define MGPU_AUTOCAST_PROMOTE(_) \
  _(stack)                       \
  _(cat)                         \
  _(index_copy)

const std::unordered_map<std::string, Policy>& policies() {
  static const auto* map = [] {
    auto* m = new std::unordered_map<std::string, Policy>();
    // "op" or "op, overload" (as the lists spell them) -> "op" / "op.overload"
    auto add = [m](std::string spelled, Policy policy) {
      std::string name;
      for (char c : spelled)
        if (c != ' ') name += c == ',' ? '.' : c;
      m->emplace(name, policy);
    };
#define MGPU_LOWER(...) add(#__VA_ARGS__, Policy::LowerPrecision);
#define MGPU_FP32(...) add(#__VA_ARGS__, Policy::Fp32);
#define MGPU_PROMOTE(...) add(#__VA_ARGS__, Policy::Promote);
    MGPU_AUTOCAST_LOWER_PRECISION(MGPU_LOWER)
    MGPU_AUTOCAST_FP32(MGPU_FP32)
    MGPU_AUTOCAST_PROMOTE(MGPU_PROMOTE)
#undef MGPU_LOWER
#undef MGPU_FP32
#undef MGPU_PROMOTE
    return m;
  }();
  return *map;
}

std::string name_of(const c10::OperatorName& op) {
  std::string name = op.name.substr(op.name.find("::") + 2);
  return op.overload_name.empty() ? name : name + "." + op.overload_name;
}

// What at::autocast::WrapFunction does for these policies, on the stack:
// eligible tensors (floating mgpu tensors, not double) are cast with ATen's
// cached_cast, then the op runs with autocast off.
void autocast_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  constexpr auto device = c10::DeviceType::PrivateUse1;
  const Policy policy = policies().at(name_of(op.operator_name()));
  const size_t n = op.schema().arguments().size();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  auto tensors_of = [](const c10::IValue& v, auto&& f) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor()) f(e.toTensor());
    }
  };
  at::ScalarType to = policy == Policy::Fp32 ? at::kFloat : at::autocast::get_lower_precision_fp_from_device_type(device);
  if (policy == Policy::Promote)
    for (auto it = first; it != stack->end(); ++it)
      tensors_of(*it, [&](const at::Tensor& t) { to = at::autocast::prioritize(to, t, device); });
  auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(to, t, device); };
  for (auto it = first; it != stack->end(); ++it) {
    if (it->isTensor()) {
      *it = cast(it->toTensor());
    } else if (it->isTensorList()) {
      c10::List<at::Tensor> out;
      for (at::Tensor t : it->toTensorList()) out.push_back(cast(t));
      *it = std::move(out);
    } else if (it->isList() && it->toList().elementType()->kind() == c10::TypeKind::OptionalType) {  // Tensor?[]
      c10::List<std::optional<at::Tensor>> out;
      for (const c10::IValue& e : it->toListRef())
        out.push_back(e.isTensor() ? std::optional<at::Tensor>(cast(e.toTensor())) : std::nullopt);
      *it = std::move(out);
    }
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastPrivateUse1);
  op.callBoxed(stack);
}

// Every other op passes through autocast untouched.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  for (const auto& [name, policy] : policies()) {
    const auto dot = name.find('.');
    const std::string op = "aten::" + name.substr(0, dot);
    const std::string overload = dot == std::string::npos ? "" : name.substr(dot + 1);
    if (c10::Dispatcher::singleton().findSchema({op, overload}))  // this torch defines it
      m.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&autocast_kernel>());
  }
}

} // namespace
} // namespace torch_mgpu::backend
