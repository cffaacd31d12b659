#include "capture/meta_cache.h"
#include "ir/lru.h"
#include "ir/partition.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <list>
#include <cstring>
#include <unordered_map>

namespace torch_mgpu::capture {

namespace {
struct Entry {
  std::vector<int64_t> key;
  MetaResult result;
};
constexpr size_t kMaxEntries = 1 << 16;
// By the key's hash (the least recently used hash goes when there are
// kMaxEntries); entries whose keys collide are told apart by their words.
// Node-based: a found result stays put while others are added.
struct Cache {
  ir::Lru<uint64_t, std::list<Entry>> map{kMaxEntries};
  // Bumped when an entry goes: memos (MetaCacheMemo) point into the
  // entries, so anything that ever erases one must bump it too.
  uint64_t generation = 1;
};

bool same_key(const std::vector<int64_t>& k, const SignatureKey& key) {
  return k.size() == key.words.size() && std::equal(k.begin(), k.end(), key.words.begin());
}
Cache& cache() {
  static auto* c = new Cache();
  return *c;
}
} // namespace

void SignatureKey::add_geometry(const ir::TensorGeometry& g) {
  add(static_cast<int64_t>(g.dtype));
  add(static_cast<int64_t>(g.sizes.size()));
  words.append(g.sizes.begin(), g.sizes.end());
  words.append(g.strides.begin(), g.strides.end());
  add(g.offset);
  add(static_cast<int64_t>(g.conj) * 2 + static_cast<int64_t>(g.neg));
}

uint64_t SignatureKey::hash() const {
  uint64_t h = words.size();
  for (int64_t w : words) h = ir::hash_combine(h, static_cast<uint64_t>(w));
  return h;
}

void SignatureKey::add_scale(double d) {
  add(13);  // (tags 1-12: add_ivalue's)
  // Its class as the node hash keys floats (0, 1, other), the others split
  // by the ranges a kernel checks when it converts the scale to the
  // tensor's dtype: a finite scale beyond half's, bfloat16's or float's
  // largest value is eager's "cannot be converted ... without overflow",
  // which the probe of a cache miss raises at the call.
  const double a = std::fabs(d);
  const int64_t range = !std::isfinite(d)                  ? 2
      : a > static_cast<double>(std::numeric_limits<float>::max())        ? 3
      : a > static_cast<double>(std::numeric_limits<c10::BFloat16>::max()) ? 4
      : a > static_cast<double>(std::numeric_limits<c10::Half>::max())     ? 5
                                                                            : 6;
  add(d == 0.0 ? 0 : d == 1.0 ? 1 : range);
}

void SignatureKey::add_ivalue(const c10::IValue& v) {
  if (v.isNone()) {
    add(1);
  } else if (v.isBool()) {
    add(2);
    add(v.toBool());
  } else if (v.isInt()) {
    add(3);
    add(v.toInt());
  } else if (v.isDouble()) {
    add(4);
    double d = v.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    add(bits);
  } else if (v.isString()) {
    add(5);
    const auto& str = v.toStringRef();
    add(static_cast<int64_t>(str.size()));
    for (size_t i = 0; i < str.size(); i += sizeof(int64_t)) {
      int64_t w = 0;
      std::memcpy(&w, str.data() + i, std::min(sizeof w, str.size() - i));
      add(w);
    }
  } else if (v.isDevice()) {
    add(6);
    add(static_cast<int64_t>(v.toDevice().type()));
    add(v.toDevice().index());
  } else if (v.isIntList()) {
    add(7);
    auto l = v.toIntList();
    add(static_cast<int64_t>(l.size()));
    for (int64_t x : l) add(x);
  } else if (v.isDoubleList()) {
    add(8);
    auto l = v.toDoubleList();
    add(static_cast<int64_t>(l.size()));
    for (double d : l) add_ivalue(c10::IValue(d));
  } else if (v.isBoolList()) {
    add(9);
    auto l = v.toBoolList();
    add(static_cast<int64_t>(l.size()));
    for (bool b : l) add(b);
  } else if (v.isScalar()) {
    add(10);
    auto s = v.toScalar();
    add(static_cast<int64_t>(s.type()));
    if (s.isFloatingPoint())
      add_ivalue(c10::IValue(s.toDouble()));
    else if (s.isIntegral(false))
      add(s.toLong());
    else if (s.isBoolean())
      add(s.toBool());
    else if (s.isComplex()) {
      add_ivalue(c10::IValue(s.toComplexDouble().real()));
      add_ivalue(c10::IValue(s.toComplexDouble().imag()));
    } else
      cacheable = false;
  } else if (v.isList()) {
    add(11);
    const auto& l = v.toListRef();
    add(static_cast<int64_t>(l.size()));
    for (const auto& e : l) add_ivalue(e);
  } else if (const auto* p = ir::partition_of(v)) {
    add(12);  // a compiled partition: its outputs depend on it alone
    add(static_cast<int64_t>(p->id));
  } else {
    cacheable = false;
  }
}

const MetaResult* meta_cache_find(const SignatureKey& key, MetaCacheMemo* memo) {
  auto& c = cache();
  if (memo && memo->generation == c.generation) {
    const auto* e = static_cast<const Entry*>(memo->entry);
    if (same_key(e->key, key)) return &e->result;
  }
  std::list<Entry>* bucket = c.map.find(key.hash());
  if (!bucket) return nullptr;
  for (Entry& e : *bucket) {
    if (!same_key(e.key, key)) continue;
    if (memo) *memo = MetaCacheMemo{&e, c.generation};
    return &e.result;
  }
  return nullptr;
}

void meta_cache_put(const SignatureKey& key, MetaResult result) {
  auto& c = cache();
  // Bounded: a shape-churning loop must not grow memory.
  auto& bucket = c.map.get(
      key.hash(), [](const std::list<Entry>&) { return false; }, [&](uint64_t, std::list<Entry>&) { ++c.generation; });
  bucket.push_back(Entry{std::vector<int64_t>(key.words.begin(), key.words.end()), std::move(result)});
}


} // namespace torch_mgpu::capture
