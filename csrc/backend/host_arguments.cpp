// Ops whose eager kernel reads an argument tensor on the host.
//
// `torch.tensor_split(x, t)` takes its split points from `t`, which eager
// requires on the CPU (it reads them to a list). With `x` on mgpu, `t` may
// be on mgpu as well: its values are read to the host (a sync, as any read
// of an mgpu tensor's values) and the split is eager's composite over those
// host values, so that dtype and shape errors are eager's. The kernel sits
// at the autograd key (and at PrivateUse1, for calls below autograd): the
// composite's views carry the gradient, as in eager.
#include "backend/backend.h"

#include <ATen/ops/tensor_split_compositeimplicitautograd_dispatch.h>
#include <torch/library.h>

namespace torch_mgpu::backend {
namespace {

std::vector<at::Tensor> tensor_split_by_tensor(const at::Tensor& self, const at::Tensor& indices_or_sections,
                                               int64_t dim) {
  if (self.device().type() == c10::DeviceType::PrivateUse1 &&
      indices_or_sections.device().type() == c10::DeviceType::PrivateUse1)
    return at::compositeimplicitautograd::tensor_split(self, indices_or_sections.cpu(), dim);
  return at::compositeimplicitautograd::tensor_split(self, indices_or_sections, dim);
}

} // namespace
} // namespace torch_mgpu::backend

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("tensor_split.tensor_indices_or_sections", TORCH_FN(torch_mgpu::backend::tensor_split_by_tensor));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("tensor_split.tensor_indices_or_sections", TORCH_FN(torch_mgpu::backend::tensor_split_by_tensor));
}
