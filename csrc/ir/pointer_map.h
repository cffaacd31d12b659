#pragma once
// Pointer -> value, open addressing in one array (linear probing, deletion
// by backward shift, no tombstones): the maps of the hot paths, where a
// node-based map made an allocation and a free per entry. A sync's node
// index (ir/graph.h: a 1000-node graph made 1000 map entries, and their
// rehash into a large bucket array sent glibc to malloc_consolidate) and
// the held bytes per storage (ir/held_bytes.cpp: every value an op
// computes at its call is held and released).
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace torch_mgpu::ir {

template <class K, class V>
class PointerMap {
 public:
  // Room for `n` entries without growing.
  void reserve(size_t n) {
    size_t cap = kMinCapacity;
    while (cap < 2 * n) cap <<= 1;
    if (cap > slots_.size()) rehash(cap);
  }
  // The value stored for `k`, nullptr where there is none.
  const V* get(const K* k) const {
    const size_t i = position(k);
    return i == kNone ? nullptr : &slots_[i].second;
  }
  V* get(const K* k) { return const_cast<V*>(static_cast<const PointerMap*>(this)->get(k)); }
  bool contains(const K* k) const { return position(k) != kNone; }
  // Stores `value` for `k` unless `k` has one: whether it was stored.
  bool insert(const K* k, V value) {
    bool made = false;
    V& v = slot_of(k, made);
    if (made) v = std::move(value);
    return made;
  }
  // The value of `k`, made (value-initialized) where there is none.
  V& get_or_make(const K* k) {
    bool made = false;
    return slot_of(k, made);
  }
  void erase(const K* k) {
    size_t hole = position(k);
    if (hole == kNone) return;
    // The slots after the hole, up to an empty one, move back into it
    // unless their home lies in (hole, j]: every key stays reachable from
    // its home.
    for (size_t j = (hole + 1) & mask_; slots_[j].first != nullptr; j = (j + 1) & mask_) {
      const size_t h = home(slots_[j].first);
      const bool stays = hole < j ? (hole < h && h <= j) : (hole < h || h <= j);
      if (stays) continue;
      slots_[hole] = std::move(slots_[j]);
      hole = j;
    }
    slots_[hole] = Slot{nullptr, V{}};
    --size_;
  }
  size_t size() const { return size_; }

 private:
  using Slot = std::pair<const K*, V>;
  static constexpr size_t kNone = ~size_t{0};
  static constexpr size_t kMinCapacity = 16;

  size_t home(const K* k) const {
    return static_cast<size_t>((reinterpret_cast<uintptr_t>(k) >> 4) * 0x9E3779B97F4A7C15ULL >> 20) & mask_;
  }
  size_t position(const K* k) const {
    if (slots_.empty()) return kNone;
    for (size_t i = home(k);; i = (i + 1) & mask_) {
      if (slots_[i].first == k) return i;
      if (slots_[i].first == nullptr) return kNone;
    }
  }
  V& slot_of(const K* k, bool& made) {
    if (2 * (size_ + 1) > slots_.size()) rehash(slots_.empty() ? kMinCapacity : 2 * slots_.size());
    for (size_t i = home(k);; i = (i + 1) & mask_) {
      if (slots_[i].first == k) return slots_[i].second;
      if (slots_[i].first == nullptr) {
        slots_[i] = Slot{k, V{}};
        ++size_;
        made = true;
        return slots_[i].second;
      }
    }
  }
  void rehash(size_t cap) {
    std::vector<Slot> old(cap, Slot{nullptr, V{}});
    old.swap(slots_);
    mask_ = cap - 1;
    size_ = 0;
    for (auto& s : old) {
      bool made = false;
      if (s.first) slot_of(s.first, made) = std::move(s.second);
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

} // namespace torch_mgpu::ir
