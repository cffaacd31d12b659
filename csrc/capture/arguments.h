#pragma once
// Walking the tensors of one boxed argument: a Tensor, a Tensor[] or a
// Tensor?[] (whose holes are kept). Other values pass through unchanged.
#include <ATen/core/ivalue.h>

#include <optional>

namespace torch_mgpu::capture {

template <class F>
void for_each_tensor(const c10::IValue& v, F&& fn) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) fn(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList())
      if (t.defined()) fn(t);
  } else if (v.isOptionalTensorList()) {
    for (const auto& e : v.toOptionalTensorList()) {
      std::optional<at::Tensor> t = e;
      if (t && t->defined()) fn(*t);
    }
  }
}

template <class F>
c10::IValue map_tensors(const c10::IValue& v, F&& fn) {
  if (v.isTensor()) return v.toTensor().defined() ? c10::IValue(fn(v.toTensor())) : v;
  if (v.isTensorList()) {
    c10::List<at::Tensor> l;
    for (const at::Tensor& t : v.toTensorList()) l.push_back(t.defined() ? fn(t) : t);
    return l;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> l;
    for (const auto& e : v.toOptionalTensorList()) {
      std::optional<at::Tensor> t = e;
      l.push_back(t && t->defined() ? std::optional<at::Tensor>(fn(*t)) : t);
    }
    return l;
  }
  return v;
}

} // namespace torch_mgpu::capture
