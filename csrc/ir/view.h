#pragma once
// A tensor over a storage with a given geometry, on the device of `key`.
// The one place that turns a TensorGeometry into a TensorImpl: mgpu tensors,
// their Meta twins for shape inference and CPU views on lanes all use it.
#include "ir/node.h"

#include <ATen/ATen.h>

namespace torch_mgpu::ir {

inline at::Tensor make_view(const c10::Storage& storage, c10::DispatchKey key, const TensorGeometry& g) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key),
                                                    c10::scalarTypeToTypeMeta(g.dtype));
  auto* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(g.sizes, g.strides, g.offset);
  if (g.conj) impl->_set_conj(true);
  if (g.neg) impl->_set_neg(true);
  return t;
}

// A tensor over `storage` with the geometry of `like` (its dtype, sizes,
// strides, offset, conj and neg bits), on the device of `key`: make_view
// without a TensorGeometry in between (ops at their call make two a call).
inline at::Tensor make_view_like(const c10::Storage& storage, c10::DispatchKey key, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key), like.dtype());
  auto* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  if (like.is_conj()) impl->_set_conj(true);
  if (like.is_neg()) impl->_set_neg(true);
  return t;
}

} // namespace torch_mgpu::ir
