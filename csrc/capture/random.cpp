#include "capture/random.h"

#include <ATen/ATen.h>
#include <c10/core/GeneratorImpl.h>

#include <mutex>
#include <random>

namespace torch_mgpu::capture {

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
} // namespace

MgpuGeneratorImpl::MgpuGeneratorImpl(c10::DeviceIndex device, uint64_t seed)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, device),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      seed_(seed) {}

void MgpuGeneratorImpl::set_current_seed(uint64_t seed) {
  seed_ = seed;
  counter_ = 0;
}
uint64_t MgpuGeneratorImpl::current_seed() const { return seed_; }
uint64_t MgpuGeneratorImpl::seed() {
  std::random_device rd;
  uint64_t s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  set_current_seed(s);
  return s;
}
void MgpuGeneratorImpl::set_offset(uint64_t offset) { counter_ = offset; }
uint64_t MgpuGeneratorImpl::get_offset() const { return counter_; }

void MgpuGeneratorImpl::set_state(const c10::TensorImpl& new_state) {
  TORCH_CHECK(new_state.numel() == 16 && new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>(),
              "mgpu generator state must be a uint8 tensor of 16 bytes");
  const auto* p = static_cast<const uint64_t*>(new_state.data());
  seed_ = p[0];
  counter_ = p[1];
}

c10::intrusive_ptr<c10::TensorImpl> MgpuGeneratorImpl::get_state() const {
  auto t = at::empty({16}, at::TensorOptions().dtype(at::kByte));
  auto* p = static_cast<uint64_t*>(t.data_ptr());
  p[0] = seed_;
  p[1] = counter_;
  return t.getIntrusivePtr();
}

uint64_t MgpuGeneratorImpl::next_seed() { return splitmix64(seed_ ^ splitmix64(counter_++)); }

MgpuGeneratorImpl* MgpuGeneratorImpl::clone_impl() const {
  auto* g = new MgpuGeneratorImpl(device().index(), seed_);
  g->counter_ = counter_;
  return g;
}

const at::Generator& default_generator(c10::DeviceIndex device) {
  static at::Generator gen = at::make_generator<MgpuGeneratorImpl>(0);
  return gen;
}

uint64_t draw_seed(const std::optional<at::Generator>& gen) {
  at::Generator g = gen.has_value() && gen->defined() ? *gen : default_generator(0);
  TORCH_CHECK(g.device().type() == c10::DeviceType::PrivateUse1,
              "Expected a 'mgpu' device type for generator but found '", g.device().type(), "'");
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get<MgpuGeneratorImpl>()->next_seed();
}

} // namespace torch_mgpu::capture
