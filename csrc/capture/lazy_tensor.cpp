#include "capture/lazy_tensor.h"

#include "ir/held_bytes.h"
#include "runtime/host_cache.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

namespace torch_mgpu::capture {

namespace {
// Every live buffer, in a ring through the buffers themselves (no
// allocation per storage). Guarded by the state lock.
LazyBuffer& registry() {
  static auto* r = [] {
    auto* head = new LazyBuffer();  // leaked: outlives static teardown
    head->prev = head->next = head;
    return head;
  }();
  return *r;
}
void link(LazyBuffer* b) {
  LazyBuffer& head = registry();
  b->prev = head.prev;
  b->next = &head;
  head.prev->next = b;
  head.prev = b;
}
void unlink(LazyBuffer* b) {
  if (!b->next) return;
  b->prev->next = b->next;
  b->next->prev = b->prev;
  b->prev = b->next = nullptr;
}

// Runs wherever a storage dies, often with the GIL held: never waits for the
// state lock (see state_lock.h).
void delete_buffer(void* ctx) {
  auto* b = static_cast<LazyBuffer*>(ctx);
  {
    StateLock lock(std::try_to_lock);
    if (lock.owns()) {
      free_buffer(b);
      return;
    }
  }
  defer_free(b);
  StateLock again(std::try_to_lock);  // freed on release, if the holder has let go meanwhile
}

// The mgpu allocator. Its storages are lazy (no bytes until computed); as
// PyTorch's DeviceAllocator it reports what mgpu values really hold
// (ir/held_bytes.h) to torch.accelerator's memory statistics.
struct LazyAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    auto* b = new LazyBuffer();
    b->value.node = ir::make_empty(nbytes);
    return adopt(b);
  }
  // Device index: storages are created through new_storage, which fixes it.
  static c10::DataPtr adopt(LazyBuffer* b) {
    if (holds_state_lock()) {
      link(b);  // a recorded call's results
    } else {
      StateLock lock;
      link(b);
    }
    return {b, b, &delete_buffer, c10::Device(c10::DeviceType::PrivateUse1, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    TORCH_CHECK(false, "mgpu storages hold no host-addressable bytes; copy through tensors");
  }

  bool initialized() override { return true; }
  // Frees what can be freed without losing a value: the blocks the lanes
  // keep for reuse.
  void emptyCache(c10::MempoolId_t) override { runtime::host_cache_empty(); }
  // Ordering on mgpu follows the data: a storage's bytes are never reused
  // while a recorded op still reads them.
  void recordStream(const c10::DataPtr&, c10::Stream) override {}

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device_index(device);
    using c10::CachingAllocator::Stat;
    const ir::HeldBytes h = ir::held_bytes();
    const int64_t cached = runtime::host_cache_stats().cached_bytes;
    auto set = [](c10::CachingAllocator::StatArray& a, int64_t current, int64_t peak, int64_t allocated,
                  int64_t freed) {
      Stat& st = a[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      st.current = current;
      st.peak = peak;
      st.allocated = allocated;
      st.freed = freed;
    };
    c10::CachingDeviceAllocator::DeviceStats out;
    set(out.allocated_bytes, h.current, h.peak, h.allocated, h.freed);
    set(out.active_bytes, h.current, h.peak, h.allocated, h.freed);
    set(out.requested_bytes, h.current, h.peak, h.allocated, h.freed);
    set(out.allocation, h.storages, h.peak_storages, h.allocations, h.frees);
    set(out.active, h.storages, h.peak_storages, h.allocations, h.frees);
    // Reserved: what is held plus the freed blocks kept for reuse. Its peak
    // is the most seen at any reading or held at once since the last reset.
    const int64_t reserved = h.current + cached;
    const int64_t seen = std::max(h.peak, reserved);
    int64_t peak = peak_reserved_.load();
    while (seen > peak && !peak_reserved_.compare_exchange_weak(peak, seen)) {
    }
    set(out.reserved_bytes, reserved, peak_reserved_.load(), h.allocated, h.freed);
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device_index(device);
    ir::reset_accumulated_held();
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check_device_index(device);
    ir::reset_peak_held();
    peak_reserved_.store(ir::held_bytes().current + runtime::host_cache_stats().cached_bytes);
  }
  // CPU lanes keep mgpu values in host memory: its free and total bytes.
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device_index(device);
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return {static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * page, static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * page};
  }

 private:
  std::atomic<int64_t> peak_reserved_{0};
};
} // namespace

void free_buffer(LazyBuffer* b) {
  unlink(b);
  delete b;  // drops the value: a dead branch of the graph is freed here
}

c10::Allocator* lazy_allocator() {
  static LazyAllocator alloc;
  return &alloc;
}

bool is_mgpu(const at::Tensor& t) {
  return t.defined() && t.device().type() == c10::DeviceType::PrivateUse1;
}

bool is_lazy_storage(const c10::Storage& storage) { return storage.data_ptr().get_deleter() == &delete_buffer; }

LazyBuffer* buffer_of(const c10::Storage& storage) {
  // Storages that PyTorch makes over another's bytes (a slice of an
  // UntypedStorage, a tensor from a DLPack capsule) have no buffer of ours.
  TORCH_CHECK_NOT_IMPLEMENTED(is_lazy_storage(storage),
                              "mgpu: this storage was not made by mgpu (a slice of an untyped storage, or a tensor from "
                              "a DLPack capsule): mgpu cannot read or write it; slice or copy the tensor instead "
                              "(x[a:b], x.clone())");
  return static_cast<LazyBuffer*>(storage.data_ptr().get_context());
}

void geometry_into(const at::Tensor& t, ir::TensorGeometry& g) {
  g.dtype = t.scalar_type();
  g.sizes.assign(t.sizes().begin(), t.sizes().end());
  g.strides.assign(t.strides().begin(), t.strides().end());
  g.offset = t.storage_offset();
  g.conj = t.is_conj();
  g.neg = t.is_neg();
}

ir::TensorGeometry geometry_of(const at::Tensor& t) {
  ir::TensorGeometry g;
  geometry_into(t, g);
  return g;
}

c10::Storage new_storage(size_t nbytes, c10::DeviceIndex device, ir::NodePtr node, int index) {
  auto* alloc = lazy_allocator();
  // A node's output needs no Empty value made first (a node of its own).
  auto* b = new LazyBuffer();
  b->value = node ? ir::Value{std::move(node), index} : ir::Value{ir::make_empty(nbytes), 0};
  b->device = device;
  c10::DataPtr dp = LazyAllocator::adopt(b);
  dp.unsafe_set_device(c10::Device(c10::DeviceType::PrivateUse1, device));
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, std::move(dp), alloc,
      /*resizable=*/true));
}

at::Tensor make_lazy_tensor(const c10::Storage& storage, const ir::TensorGeometry& geom) {
  return ir::make_view(storage, c10::DispatchKey::PrivateUse1, geom);
}

at::Tensor meta_view(const c10::Storage& meta_storage, const ir::TensorGeometry& geom) {
  return ir::make_view(meta_storage, c10::DispatchKey::Meta, geom);
}

std::vector<LazyBuffer*> pending_buffers() {
  StateLock lock;
  std::vector<LazyBuffer*> out;
  const LazyBuffer* head = &registry();
  for (LazyBuffer* b = head->next; b != head; b = b->next)
    if (b->value.node && b->value.node->is_pending()) out.push_back(b);
  return out;
}

void check_device_index(c10::DeviceIndex index) {
  c10::DeviceIndex n = 1;  // one virtual mgpu device spans all lanes
  // As CUDA reports it: torch.AcceleratorError (a RuntimeError).
  if (index < -1 || index >= n)
    throw c10::AcceleratorError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, /*code=*/101,
                                c10::str("mgpu error: invalid device ordinal: device index ", static_cast<int>(index),
                                         " is out of range: torch.mgpu.device_count() is ", static_cast<int>(n)));
}

} // namespace torch_mgpu::capture
