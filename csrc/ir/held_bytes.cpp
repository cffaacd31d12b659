#include "ir/held_bytes.h"
#include "ir/fork_order.h"

#include <pthread.h>

#include <mutex>
#include <vector>

namespace torch_mgpu::ir {
namespace {

struct Entry {
  int64_t holders = 0;
  int64_t nbytes = 0;
};

// Storage -> its entry, open addressing in one array (linear probing,
// deletion by backward shift): every value an op computes at its call is
// held, and a node-based map made an allocation and a free for each.
class LiveMap {
 public:
  // The entry of `k`, made (zeroed) where there is none.
  Entry& get(const c10::StorageImpl* k) {
    if (2 * (size_ + 1) > slots_.size()) rehash(slots_.empty() ? 64 : 2 * slots_.size());
    for (size_t i = home(k);; i = (i + 1) & mask_) {
      if (slots_[i].key == k) return slots_[i].entry;
      if (slots_[i].key == nullptr) {
        slots_[i] = Slot{k, Entry{}};
        ++size_;
        return slots_[i].entry;
      }
    }
  }
  // The entry of `k`, nullptr where there is none.
  Entry* find(const c10::StorageImpl* k) {
    const size_t i = position(k);
    return i == kNone ? nullptr : &slots_[i].entry;
  }
  void erase(const c10::StorageImpl* k) {
    size_t hole = position(k);
    if (hole == kNone) return;
    // The slots after the hole, up to an empty one, move back into it
    // unless their home lies in (hole, j]: every key stays reachable from
    // its home without tombstones.
    for (size_t j = (hole + 1) & mask_; slots_[j].key != nullptr; j = (j + 1) & mask_) {
      const size_t h = home(slots_[j].key);
      const bool stays = hole < j ? (hole < h && h <= j) : (hole < h || h <= j);
      if (stays) continue;
      slots_[hole] = slots_[j];
      hole = j;
    }
    slots_[hole].key = nullptr;
    --size_;
  }
  size_t size() const { return size_; }

 private:
  static constexpr size_t kNone = ~size_t{0};
  struct Slot {
    const c10::StorageImpl* key = nullptr;
    Entry entry;
  };
  size_t home(const c10::StorageImpl* k) const {
    return static_cast<size_t>((reinterpret_cast<uintptr_t>(k) >> 4) * 0x9E3779B97F4A7C15ULL >> 20) & mask_;
  }
  size_t position(const c10::StorageImpl* k) const {
    if (slots_.empty()) return kNone;
    for (size_t i = home(k);; i = (i + 1) & mask_) {
      if (slots_[i].key == k) return i;
      if (slots_[i].key == nullptr) return kNone;
    }
  }
  void rehash(size_t cap) {
    std::vector<Slot> old(cap);
    old.swap(slots_);
    mask_ = cap - 1;
    size_ = 0;
    for (const auto& s : old)
      if (s.key) get(s.key) = s.entry;
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

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
  Entry& e = r.live.get(impl);
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
  Entry* e = r.live.find(impl);
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
