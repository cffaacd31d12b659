// Factorizations that check LAPACK's info on the host, recorded whole.
//
// torch.linalg.cholesky, inv, solve, lu_factor and ldl_factor are composite
// ops: the *_ex op, then _linalg_check_errors, which reads `info` on the
// host. On mgpu that read is a sync at every call, so independent branches
// that each factorize a matrix (the heads of a kernel method) could never
// overlap. Here the composite op is recorded as one node; its CPU kernel
// (the same composite, on the lane) raises eager's error, torch.linalg's
// LinAlgError included, at the sync that runs it, and the result is a value
// that failed, as for any op that raises on a lane.
//
// Autograd: when a gradient is wanted (grad mode and an input that requires
// grad, or a forward-mode tangent) the composite runs as in eager, so the
// *_ex op carries the derivative and the check syncs. Otherwise the op goes
// below autograd to the PrivateUse1 kernel, which records it.
#include "backend/backend.h"
#include "capture/capture.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/linalg_cholesky_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/linalg_inv_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/linalg_ldl_factor_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/linalg_lu_factor_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/linalg_solve_compositeimplicitautograd_dispatch.h>
#include <ATen/RedispatchFunctions.h>
#include <torch/library.h>

namespace torch_mgpu::backend {
namespace {

at::Tensor linalg_cholesky(c10::DispatchKeySet ks, const at::Tensor& A, bool upper) {
  if (wants_grad(A)) return at::compositeimplicitautograd::linalg_cholesky(A, upper);
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::redispatch::linalg_cholesky(below_autograd(ks), A, upper);
}

at::Tensor linalg_inv(c10::DispatchKeySet ks, const at::Tensor& A) {
  if (wants_grad(A)) return at::compositeimplicitautograd::linalg_inv(A);
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::redispatch::linalg_inv(below_autograd(ks), A);
}

at::Tensor linalg_solve(c10::DispatchKeySet ks, const at::Tensor& A, const at::Tensor& B, bool left) {
  if (wants_grad(A) || wants_grad(B)) return at::compositeimplicitautograd::linalg_solve(A, B, left);
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::redispatch::linalg_solve(below_autograd(ks), A, B, left);
}

std::tuple<at::Tensor, at::Tensor> linalg_lu_factor(c10::DispatchKeySet ks, const at::Tensor& A, bool pivot) {
  if (wants_grad(A)) return at::compositeimplicitautograd::linalg_lu_factor(A, pivot);
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::redispatch::linalg_lu_factor(below_autograd(ks), A, pivot);
}

std::tuple<at::Tensor, at::Tensor> linalg_ldl_factor(c10::DispatchKeySet ks, const at::Tensor& A, bool hermitian) {
  if (wants_grad(A)) return at::compositeimplicitautograd::linalg_ldl_factor(A, hermitian);
  at::AutoDispatchBelowADInplaceOrView guard;
  return at::redispatch::linalg_ldl_factor(below_autograd(ks), A, hermitian);
}

} // namespace
} // namespace torch_mgpu::backend

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  using namespace torch_mgpu::backend;
  m.impl("linalg_cholesky", TORCH_FN(linalg_cholesky));
  m.impl("linalg_inv", TORCH_FN(linalg_inv));
  m.impl("linalg_solve", TORCH_FN(linalg_solve));
  m.impl("linalg_lu_factor", TORCH_FN(linalg_lu_factor));
  m.impl("linalg_ldl_factor", TORCH_FN(linalg_ldl_factor));
}

// The PrivateUse1 kernel records the op (the boxed fallback is not reached:
// the composite kernel counts as PrivateUse1's own).
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"linalg_cholesky", "linalg_inv", "linalg_solve", "linalg_lu_factor", "linalg_ldl_factor"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&torch_mgpu::backend::mgpu_fallback>());
}
