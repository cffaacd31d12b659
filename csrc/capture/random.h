#pragma once
// The mgpu generator. Random ops are recorded with a seed drawn from it at
// capture time, so results depend only on torch.manual_seed and the order of
// the calls, never on the lane count or the schedule.
#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

namespace torch_mgpu::capture {

struct MgpuGeneratorImpl : public c10::GeneratorImpl {
  explicit MgpuGeneratorImpl(c10::DeviceIndex device = 0, uint64_t seed = 67280421310721ull);
  void set_current_seed(uint64_t seed) override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }
  // The seed for the next random op; advances the generator.
  uint64_t next_seed();

 private:
  MgpuGeneratorImpl* clone_impl() const override;
  uint64_t seed_;
  uint64_t counter_ = 0;
};

const at::Generator& default_generator(c10::DeviceIndex device);
// Next seed from `gen` (an mgpu generator) or the default one when undefined.
uint64_t draw_seed(const std::optional<at::Generator>& gen);

} // namespace torch_mgpu::capture
