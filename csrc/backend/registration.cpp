// PrivateUse1 registration under the name `mgpu`: the device guard, the
// allocator, the hooks and the generator. Runs from static initializers when
// libtorch_mgpu loads, so C++ users get the device with no Python.
#include "backend/backend.h"
#include "capture/capture.h"
#include "engine/at_call.h"
#include "engine/engine.h"
#include "capture/lazy_tensor.h"
#include "capture/random.h"
#include "engine/events.h"

#include <atomic>

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

namespace torch_mgpu::backend {
namespace {

thread_local c10::DeviceIndex t_current_device = 0;
// The current stream of this thread (one mgpu device): 0 is the default.
thread_local c10::StreamId t_current_stream = 0;
std::atomic<c10::StreamId> g_next_stream{1};

engine::Event* as_event(void* event) { return static_cast<engine::Event*>(event); }

// Streams on mgpu are names, not queues: work is ordered by its data, and the
// planner puts independent work on lanes whatever stream recorded it, so
// results never depend on streams (code written for CUDA streams, with or
// without events between them, computes what eager code computes). Each
// new stream gets its own id, and a thread has a current stream, as on
// CUDA. Events mark points in the recorded program (engine/events.h).
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
    capture::check_device_index(d.index());
    if (d.index() >= 0) t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < deviceCount()) t_current_device = d.index();
  }
  static c10::Device device_of(c10::Device d) {
    capture::check_device_index(d.index());
    return c10::Device(T, d.index() < 0 ? t_current_device : d.index());
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, device_of(d), t_current_stream);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, device_of(d));
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return c10::Stream(c10::Stream::UNSAFE, device_of(d), g_next_stream.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool isHighPriority) const override {
    return getNewStream(d, isHighPriority ? -1 : 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    t_current_stream = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(stream.device_type() == T, "mgpu: an event can only be recorded on an mgpu stream, got ", stream);
    if (*event == nullptr) *event = new engine::Event(flag == c10::EventFlag::BACKEND_DEFAULT);
    as_event(*event)->record();
  }
  // Ordering follows the data: a stream waiting for an event has nothing to
  // wait for that the planner would not order anyway.
  void block(void* event, const c10::Stream& stream) const override {}
  bool queryEvent(void* event) const override { return event == nullptr || as_event(event)->query(); }
  void destroyEvent(void* event, const c10::DeviceIndex device_index) const noexcept override {
    delete as_event(event);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex device_index) const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "Both events must be recorded before calculating elapsed time.");
    return as_event(start)->elapsed_ms(*as_event(end));
  }
  // A stream is idle when nothing recorded is left to run.
  bool queryStream(const c10::Stream& stream) const override { return engine::stream_idle(); }
  // Waiting for the device (torch.accelerator.synchronize(), a stream's or an
  // event's synchronize()) runs what is pending and raises its first error,
  // as torch_mgpu.synchronize() does: on mgpu, work is done when it has run.
  void synchronizeStream(const c10::Stream& stream) const override {
    engine::at_call::ProgramRead read;
    engine::sync_all();
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) as_event(event)->synchronize();
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    capture::check_device_index(device_index);
    engine::at_call::ProgramRead read;
    engine::sync_all();
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

struct MgpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    capture::check_device_index(device_index);
    return capture::default_generator(device_index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    capture::check_device_index(device_index);
    return at::make_generator<capture::MgpuGeneratorImpl>(device_index < 0 ? 0 : device_index);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    return {c10::DeviceType::PrivateUse1, 0};
  }
  bool isPinnedPtr(const void* data) const override { return false; }
  at::Allocator* getPinnedMemoryAllocator() const override { return at::getCPUAllocator(); }
  bool hasPrimaryContext(c10::DeviceIndex device_index) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  void setCurrentDevice(c10::DeviceIndex device) const override { capture::check_device_index(device); }
  c10::DeviceIndex getCurrentDevice() const override { return t_current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    capture::check_device_index(device);
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
  // Views are metadata: ATen's own view kernels (the CPU's and Meta's) make
  // a TensorImpl over the same storage with eager's checks and errors, with
  // no recording (no signature, Meta run or lock: a view costs what it costs
  // on the CPU). transpose, unsqueeze, select, slice, expand, permute... are
  // composites that end in as_strided.
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, MgpuGuardImpl);
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, capture::lazy_allocator());

} // namespace torch_mgpu::backend
