#pragma once
// Walking the tensors of one boxed argument: a Tensor, a Tensor[] or a
// Tensor?[] (whose holes are kept). Other values pass through unchanged.
#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

#include <optional>

namespace torch_mgpu::capture {

// A Generator or Generator? argument (signature.cpp).
bool is_generator(const c10::Argument& a);

template <class F>
void for_each_tensor(const c10::IValue& v, F&& fn) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) fn(v.toTensor());
  } else if (v.isTensorList()) {
    for (at::Tensor t : v.toTensorList())  // by value: the list yields proxies
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
    for (at::Tensor t : v.toTensorList()) l.push_back(t.defined() ? fn(t) : t);
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

// TorchScript may hand a Tensor[] or Tensor?[] argument over as a list whose
// element type is an equal but distinct type object, which isTensorList()
// and isOptionalTensorList() do not recognize: gives such lists their typed
// form in place, so that the walks above see their tensors.
inline void type_tensor_lists(const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  const size_t n = schema.arguments().size();
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[stack->size() - n + i];
    if (!v.isList() || v.isTensorList() || v.isOptionalTensorList()) continue;
    const auto& type = schema.arguments()[i].type();
    if (type->kind() != c10::TypeKind::ListType) continue;
    const auto& elem = type->castRaw<c10::ListType>()->getElementType();
    if (elem->kind() == c10::TypeKind::TensorType) {
      c10::List<at::Tensor> l;
      for (const auto& e : v.toListRef()) l.push_back(e.toTensor());
      v = l;
    } else if (elem->kind() == c10::TypeKind::OptionalType &&
               elem->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType) {
      c10::List<std::optional<at::Tensor>> l;
      for (const auto& e : v.toListRef()) l.push_back(e.isNone() ? std::nullopt : std::optional<at::Tensor>(e.toTensor()));
      v = l;
    }
  }
}

} // namespace torch_mgpu::capture
