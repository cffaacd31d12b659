#include "ir/held_bytes.h"
#include "ir/fork_order.h"
#include "ir/pointer_map.h"

#include <pthread.h>

#include <mutex>
#include <vector>

namespace torch_mgpu::ir {
namespace {

struct Entry {
  int64_t holders = 0;
  int64_t nbytes = 0;
};

// Storage -> its entry (every value an op computes at its call is held).
using LiveMap = PointerMap<c10::StorageImpl, Entry>;

struct Registry {
  std::mutex m;
  LiveMap live;
  HeldBytes stats;
};

Registry& registry() {
  static auto* r = [] {
    auto* reg = new Registry();  // leaked: storages die during static teardown
    // Lanes hold and release while a flight runs: a fork then must not
    // leave the mutex locked in the child.
    ir::on_fork(ir::ForkRank::Registry, [] { registry().m.lock(); }, [] { registry().m.unlock(); }, [] { registry().m.unlock(); });
    return reg;
  }();
  return *r;
}

} // namespace

void hold(const c10::Storage& s) {
  const c10::StorageImpl* impl = s.unsafeGetStorageImpl();
  if (impl == nullptr) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  Entry& e = r.live.get_or_make(impl);
  if (e.holders++ > 0) return;
  e.nbytes = static_cast<int64_t>(s.nbytes());
  HeldBytes& st = r.stats;
  st.current += e.nbytes;
  st.allocated += e.nbytes;
  st.storages++;
  st.allocations++;
  if (st.current > st.peak) st.peak = st.current;
  if (st.storages > st.peak_storages) st.peak_storages = st.storages;
}

void release(const c10::Storage& s) {
  const c10::StorageImpl* impl = s.unsafeGetStorageImpl();
  if (impl == nullptr) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  Entry* e = r.live.get(impl);
  if (e == nullptr || --e->holders > 0) return;
  HeldBytes& st = r.stats;
  st.current -= e->nbytes;
  st.freed += e->nbytes;
  st.storages--;
  st.frees++;
  r.live.erase(impl);
}

HeldBytes held_bytes() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  return r.stats;
}

void reset_peak_held() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  r.stats.peak = r.stats.current;
  r.stats.peak_storages = r.stats.storages;
}

void reset_accumulated_held() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  r.stats.allocated = 0;
  r.stats.freed = 0;
  r.stats.allocations = 0;
  r.stats.frees = 0;
}

} // namespace torch_mgpu::ir
