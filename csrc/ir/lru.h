#pragma once
// A bounded map that lets go of its least recently used entries: the one
// eviction rule of every cache (plans, hot graphs, Meta results, the
// programs a worker keeps). Entries stay at their address until they go.
// Not synchronized: each cache guards it with its own lock.
#include <cstddef>
#include <functional>
#include <list>
#include <unordered_map>
#include <utility>

namespace torch_mgpu::ir {

template <class K, class V, class Hash = std::hash<K>>
class Lru {
 public:
  explicit Lru(size_t capacity) : capacity_(capacity) {}

  // The entry of `k`, now the most recently used; null if there is none.
  V* find(const K& k) {
    auto it = index_.find(k);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return &it->second->second;
  }
  // The entry of `k` as it is (its use not counted); null if there is none.
  V* peek(const K& k) {
    auto it = index_.find(k);
    return it == index_.end() ? nullptr : &it->second->second;
  }

  // The entry of `k`, now the most recently used, made (V()) if there is
  // none (`made` says which). A new entry past the capacity makes the least
  // recently used ones go, except those `keep(value)` holds on to (the
  // cache may then stay over its capacity); `gone(key, value)` sees each
  // before it goes.
  template <class Keep, class Gone>
  V& get(const K& k, Keep keep, Gone gone, bool* made = nullptr) {
    if (V* v = find(k)) {
      if (made) *made = false;
      return *v;
    }
    if (made) *made = true;
    if (index_.size() >= capacity_) {
      for (auto it = order_.end(); it != order_.begin() && index_.size() >= capacity_;) {
        --it;
        if (keep(it->second)) continue;
        gone(it->first, it->second);
        index_.erase(it->first);
        it = order_.erase(it);
      }
    }
    order_.emplace_front(k, V());
    index_.emplace(k, order_.begin());
    return order_.front().second;
  }
  V& get(const K& k, bool* made = nullptr) {
    return get(k, [](const V&) { return false; }, [](const K&, V&) {}, made);
  }

  void erase(const K& k) {
    auto it = index_.find(k);
    if (it == index_.end()) return;
    order_.erase(it->second);
    index_.erase(it);
  }
  void clear() {
    index_.clear();
    order_.clear();
  }
  size_t size() const { return index_.size(); }
  size_t capacity() const { return capacity_; }
  // Each (key, value), the most recently used first.
  template <class F>
  void for_each(F f) {
    for (auto& [k, v] : order_) f(k, v);
  }

 private:
  size_t capacity_;
  std::list<std::pair<K, V>> order_;  // the most recently used first
  std::unordered_map<K, typename std::list<std::pair<K, V>>::iterator, Hash> index_;
};

} // namespace torch_mgpu::ir
