#pragma once
// The bytes mgpu values really hold: the storages of materialized values
// (Data nodes and their copies on other devices) and the intermediate values
// of a plan while it runs, on the host for CPU lanes and on the GPU for
// stream lanes. Behind torch.accelerator.memory_allocated() and friends.
//
// Counted per storage, once however many values share it (an in-place
// result that reused its operand's bytes, a value and its replica list):
// hold() and release() are paired per holder.
#include <c10/core/Storage.h>

#include <cstdint>

namespace torch_mgpu::ir {

void hold(const c10::Storage& s);
void release(const c10::Storage& s);

struct HeldBytes {
  int64_t current = 0;      // bytes held now
  int64_t peak = 0;         // most held at once since the last reset_peak
  int64_t allocated = 0;    // bytes that started being held, cumulative
  int64_t freed = 0;        // bytes that stopped being held, cumulative
  int64_t storages = 0;     // storages held now
  int64_t peak_storages = 0;
  int64_t allocations = 0;  // storages that started being held, cumulative
  int64_t frees = 0;
};
HeldBytes held_bytes();
void reset_peak_held();
void reset_accumulated_held();

} // namespace torch_mgpu::ir
