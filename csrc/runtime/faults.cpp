#include "runtime/faults.h"
#include "ir/env.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

namespace torch_mgpu::runtime {

namespace {
constexpr int kPoints = static_cast<int>(FaultPoint::Count);
constexpr std::array<const char*, kPoints> kNames = {"node", "transfer", "event_wait", "stream_sync", "drop_event_wait", "drop_record_use",
                                                     "program"};

struct Faults {
  std::array<std::atomic<int64_t>, kPoints> countdown{};  // 0: disarmed
  std::array<std::atomic<int64_t>, kPoints> fired{};
  // Occurrences counted only where `what` equals this (empty: all). Read
  // only while the point is armed.
  std::mutex m;
  std::array<std::string, kPoints> only;
  Faults() {
    // TORCH_MGPU_FAULT=point:n
    if (const auto e = ir::env::text(ir::env::Var::Fault)) {
      const std::string& s = *e;
      auto colon = s.find(':');
      int64_t n = colon == std::string::npos ? 1 : std::atoll(s.c_str() + colon + 1);
      countdown[index(s.substr(0, colon))].store(n);
    }
  }
  static int index(const std::string& name) {
    for (int k = 0; k < kPoints; ++k)
      if (name == kNames[k]) return k;
    TORCH_CHECK(false, "torch_mgpu: unknown fault point '", name,
                "' (expected 'node', 'transfer', 'event_wait', 'stream_sync', 'drop_event_wait', 'drop_record_use' or 'program')");
  }
};

Faults& faults() {
  static auto* f = new Faults();
  return *f;
}
} // namespace

void inject_fault(const std::string& point, int64_t n, const std::string& only) {
  TORCH_CHECK(n >= 0, "torch_mgpu: a fault's occurrence must be >= 0, got ", n);
  const int k = Faults::index(point);
  {
    std::lock_guard<std::mutex> lock(faults().m);
    faults().only[k] = only;
  }
  faults().countdown[k].store(n);
}

int64_t faults_fired(const std::string& point) { return faults().fired[Faults::index(point)].load(); }

namespace {
// Counts an occurrence of `point`: true when it is the armed one.
bool due(int k, std::string_view what = {}) {
  auto& c = faults().countdown[k];
  int64_t left = c.load(std::memory_order_relaxed);
  if (left <= 0) return false;
  {
    std::lock_guard<std::mutex> lock(faults().m);
    if (!faults().only[k].empty() && faults().only[k] != what) return false;
  }
  while (left > 0) {
    if (c.compare_exchange_weak(left, left - 1)) {
      if (left != 1) return false;
      faults().fired[k]++;
      return true;
    }
  }
  return false;
}
} // namespace

void fault_point(FaultPoint point, std::string_view what) {
  const int k = static_cast<int>(point);
  if (due(k, what)) TORCH_CHECK(false, "mgpu: injected fault (", kNames[k], what.empty() ? "" : ": ", what, ")");
}

bool fault_drops(FaultPoint point) { return due(static_cast<int>(point)); }

} // namespace torch_mgpu::runtime
