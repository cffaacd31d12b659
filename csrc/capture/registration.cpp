// PrivateUse1 registration under the name `mgpu`: the device guard, the
// allocator, the hooks and the generator. Runs from static initializers when
// libtorch_mgpu loads, so C++ users get the device with no Python.
#include "capture/capture.h"
#include "capture/lazy_tensor.h"
#include "capture/random.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

namespace torch_mgpu::capture {
namespace {

thread_local c10::DeviceIndex t_current_device = 0;

// mgpu has one stream per device: ordering between lanes is the executor's
// business, so events and streams are trivially satisfied here.
struct MgpuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType T = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return T; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {T, t_current_device}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == T, "expected an mgpu device, got ", d);
    check_device_index(d.index());
    if (d.index() >= 0) t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < deviceCount()) t_current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(T, d.index() < 0 ? t_current_device : d.index()));
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override { return getStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return getStream(s.device()); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {}
  void block(void* event, const c10::Stream& stream) const override {}
  bool queryEvent(void* event) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex device_index) const noexcept override {}
  bool queryStream(const c10::Stream& stream) const override { return true; }
  // Waiting for the device (torch.accelerator.synchronize(), a stream's or an
  // event's synchronize()) runs what is pending and raises its first error,
  // as torch_mgpu.synchronize() does: on mgpu, work is done when it has run.
  void synchronizeStream(const c10::Stream& stream) const override { sync_all(); }
  void synchronizeEvent(void* event) const override { sync_all(); }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    check_device_index(device_index);
    sync_all();
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

struct MgpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    check_device_index(device_index);
    return default_generator(device_index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    check_device_index(device_index);
    return at::make_generator<MgpuGeneratorImpl>(device_index < 0 ? 0 : device_index);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    return {c10::DeviceType::PrivateUse1, 0};
  }
  bool isPinnedPtr(const void* data) const override { return false; }
  at::Allocator* getPinnedMemoryAllocator() const override { return at::getCPUAllocator(); }
  bool hasPrimaryContext(c10::DeviceIndex device_index) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  void setCurrentDevice(c10::DeviceIndex device) const override { check_device_index(device); }
  c10::DeviceIndex getCurrentDevice() const override { return t_current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    check_device_index(device);
    return t_current_device;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return t_current_device;
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    TORCH_CHECK(false, "mgpu storages are resized through Tensor.resize_");
  }
};

struct Registrar {
  Registrar() {
    c10::register_privateuse1_backend("mgpu");
    at::RegisterPrivateUse1HooksInterface(new MgpuHooks());  // lives for the process
  }
};
Registrar g_registrar;

// Whether `from` may take `self`'s place in its TensorImpl (Variable::set_data,
// `param.data = ...`). An mgpu tensor is an ordinary dense TensorImpl over a
// lazy storage, so dense CPU and mgpu tensors may replace each other, as CPU
// and CUDA tensors do: module.to("mgpu") (Python's _apply, C++'s
// nn::Module::to) then keeps each Parameter and buffer object, so weights
// tied across modules stay tied and an optimizer made before the move steps
// the moved tensors.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.device().is_cpu() || t.device().is_privateuseone());
  };
  if (dense(self) && dense(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", &has_compatible_shallow_copy_type);
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, MgpuGuardImpl);
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, lazy_allocator());

} // namespace torch_mgpu::capture
