#pragma once
// The lazy side of an mgpu tensor. An mgpu tensor is an ordinary TensorImpl
// (sizes, strides, offset, dtype) over an ordinary StorageImpl; the storage's
// DataPtr context is a LazyBuffer, which names the storage's current contents
// as an IR Value. Views share the StorageImpl exactly as CPU views do; an
// in-place op records a node that produces the storage's next version.
#include "capture/state_lock.h"
#include "ir/node.h"
#include "ir/view.h"

#include <ATen/ATen.h>

#include <mutex>
#include <vector>

namespace torch_mgpu::capture {

struct LazyBuffer {
  // Current version of the storage's bytes. Guarded by the state lock.
  ir::Value value;
  c10::DeviceIndex device = 0;
  // The ring of live buffers (lazy_tensor.cpp). Guarded by the state lock.
  LazyBuffer* prev = nullptr;
  LazyBuffer* next = nullptr;
};

// The allocator behind mgpu storages: allocating creates a LazyBuffer whose
// contents are uninitialized (an Empty value); nothing is allocated on a lane
// until a node writes it.
c10::Allocator* lazy_allocator();

bool is_mgpu(const at::Tensor& t);
// Whether `storage` is an mgpu storage made here (it has a LazyBuffer).
bool is_lazy_storage(const c10::Storage& storage);
// The LazyBuffer of an mgpu storage; refuses (NotImplementedError, by name) a
// storage mgpu did not make.
LazyBuffer* buffer_of(const c10::Storage& storage);
inline LazyBuffer* buffer_of(const at::Tensor& t) { return buffer_of(t.storage()); }

ir::TensorGeometry geometry_of(const at::Tensor& t);
// The same, written into `g` (built in place where it is kept).
void geometry_into(const at::Tensor& t, ir::TensorGeometry& g);

// A new mgpu storage of `nbytes` whose value is `value` (Empty when null).
c10::Storage new_storage(size_t nbytes, c10::DeviceIndex device, ir::NodePtr node = nullptr, int index = 0);
// An mgpu tensor over `storage` with `geom`.
at::Tensor make_lazy_tensor(const c10::Storage& storage, const ir::TensorGeometry& geom);
// A Meta tensor with `geom` over `meta_storage`.
at::Tensor meta_view(const c10::Storage& meta_storage, const ir::TensorGeometry& geom);

// The buffers alive now with a pending (not yet computed) value.
std::vector<LazyBuffer*> pending_buffers();

// Checks `index` against the mgpu device count; raises a clear error.
void check_device_index(c10::DeviceIndex index);

} // namespace torch_mgpu::capture
