#include "capture/caller.h"
#include "ir/env.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace torch_mgpu::capture {

namespace {
std::atomic<CallerProvider>& provider_slot() {
  static std::atomic<CallerProvider> p{nullptr};
  return p;
}
bool enabled() {
  static const bool on = ir::env::on_unless_zero(ir::env::Var::Caller);
  return on;
}
} // namespace

void set_caller_provider(CallerProvider provider) { provider_slot().store(provider); }

std::string_view caller_location() {
  if (!enabled()) return {};
  CallerProvider p = provider_slot().load(std::memory_order_relaxed);
  return p ? p() : std::string_view();
}

} // namespace torch_mgpu::capture
