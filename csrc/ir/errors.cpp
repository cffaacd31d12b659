#include "ir/errors.h"

#include <atomic>

namespace torch_mgpu::ir {
namespace {
std::atomic<bool (*)(const std::exception&)> g_interrupt_test{nullptr};
} // namespace

void set_interrupt_test(bool (*test)(const std::exception&)) { g_interrupt_test.store(test); }

bool is_interrupt(const std::exception& e) {
  auto* test = g_interrupt_test.load();
  return test && test(e);
}

void rethrow_if_interrupt(const std::exception& e) {
  if (is_interrupt(e)) throw;
}

} // namespace torch_mgpu::ir
