#include "runtime/place.h"
#include "runtime/remote.h"

#include "ir/view.h"
#include "runtime/sanitizer.h"

#include <ATen/Context.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/TensorOptions.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstring>

namespace torch_mgpu::runtime {

c10::Device physical_device(const std::string& name) {
  if (name == "cpu" || name.rfind("cpu:", 0) == 0 || name.rfind("rank", 0) == 0) return c10::Device(c10::kCPU);
  c10::Device d(name);  // "cuda:N"; raises on anything malformed
  TORCH_CHECK(d.is_cuda() && d.has_index(), "torch_mgpu: unknown device '", name,
              "' (expected 'cpu' or 'cuda:N')");
  return d;
}

c10::Device device_on_rank(const std::string& name) {
  const size_t colon = name.find(':');
  TORCH_CHECK(name.rfind("rank", 0) == 0 && colon != std::string::npos, "torch_mgpu: '", name,
              "' is not a device of another rank");
  return c10::Device(name.substr(colon + 1));
}

int cuda_device_count() {
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return 0;
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount();
}

void init_cuda() { at::globalContext().lazyInitDevice(c10::DeviceType::CUDA); }

std::vector<Place> make_places(const plan::Topology& t) {
  std::vector<Place> out;
  out.reserve(t.lanes.size());
  for (const auto& lane : t.lanes) {
    Place p;
    p.device = physical_device(t.devices[lane.device]);
    if (lane.rank > 0) {
      p.kind = LaneKind::Remote;
      p.remote = remote(lane.rank);
      p.there = device_on_rank(t.devices[lane.device]);
      out.push_back(p);
      continue;
    }
    // Under the stream sanitizer, CPU lanes are stream lanes too.
    if (!p.device.is_cpu() || stream_sanitizer_on()) {
      if (p.device.is_cuda()) init_cuda();
      c10::impl::VirtualGuardImpl impl(p.device.type());
      p.stream = impl.getStreamFromGlobalPool(p.device, /*isHighPriority=*/false);
      p.kind = LaneKind::Stream;
    }
    out.push_back(p);
  }
  return out;
}

at::Tensor view(const c10::Storage& storage, const ir::TensorGeometry& geom) {
  c10::Device d = storage.device();
  c10::DispatchKey key =
      d.is_cpu() ? c10::DispatchKey::CPU : c10::computeDispatchKey(geom.dtype, c10::kStrided, d);
  return ir::make_view(storage, key, geom);
}

at::Tensor byte_view(const c10::Storage& storage, size_t nbytes) {
  ir::TensorGeometry flat;
  flat.dtype = c10::ScalarType::Byte;
  flat.sizes = {static_cast<int64_t>(nbytes)};
  flat.strides = {1};
  return view(storage, flat);
}

c10::Storage placeholder(size_t nbytes) {
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                           c10::DataPtr(nullptr, c10::Device(c10::kMeta)), nullptr,
                                                           false));
}

c10::Storage allocate(size_t nbytes, c10::Device device) {
  c10::OptionalDeviceGuard guard;
  if (!device.is_cpu()) guard.reset_device(device);
  auto* alloc = c10::GetAllocator(device.type());
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, alloc->allocate(nbytes), alloc, true));
}

void zero(const c10::Storage& s) {
  if (!s.nbytes()) return;
  if (s.device().is_cpu()) {
    std::memset(s.mutable_data(), 0, s.nbytes());
    return;
  }
  c10::DeviceGuard guard(s.device());
  byte_view(s, s.nbytes()).zero_();
}

c10::Storage copy_to(const c10::Storage& src, c10::Device device, bool wait) {
  c10::Storage dst = allocate(src.nbytes(), device);
  if (!src.nbytes()) return dst;
  if (src.device().is_cpu() && device.is_cpu()) {
    std::memcpy(dst.mutable_data(), src.data(), src.nbytes());
    return dst;
  }
  c10::DeviceGuard guard(device.is_cpu() ? src.device() : device);
  byte_view(dst, dst.nbytes()).copy_(byte_view(src, src.nbytes()), /*non_blocking=*/!device.is_cpu() && !wait);
  return dst;
}

void record_use(const c10::Storage& s, const c10::Stream& stream) {
  if (!s.nbytes()) return;
  c10::impl::VirtualGuardImpl impl(s.device().type());
  impl.recordDataPtrOnStream(s.data_ptr(), stream);
}

} // namespace torch_mgpu::runtime
