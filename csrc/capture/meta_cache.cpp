#include "capture/meta_cache.h"
#include "ir/partition.h"

#include <cstring>
#include <unordered_map>

namespace torch_mgpu::capture {

namespace {
struct Cache {
  std::unordered_map<std::string, MetaResult> map;
};
Cache& cache() {
  static auto* c = new Cache();
  return *c;
}
constexpr size_t kMaxEntries = 1 << 16;
} // namespace

void SignatureKey::add_geometry(const ir::TensorGeometry& g) {
  // Sizes and strides go in whole: the key is built on every recorded call.
  const int64_t head[2] = {static_cast<int64_t>(g.dtype), static_cast<int64_t>(g.sizes.size())};
  const int64_t tail[2] = {g.offset, static_cast<int64_t>(g.conj) * 2 + static_cast<int64_t>(g.neg)};
  bytes.append(reinterpret_cast<const char*>(head), sizeof head);
  bytes.append(reinterpret_cast<const char*>(g.sizes.data()), g.sizes.size() * sizeof(int64_t));
  bytes.append(reinterpret_cast<const char*>(g.strides.data()), g.strides.size() * sizeof(int64_t));
  bytes.append(reinterpret_cast<const char*>(tail), sizeof tail);
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
    add(static_cast<int64_t>(v.toStringRef().size()));
    bytes += v.toStringRef();
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
    for (double d : v.toDoubleList()) add_ivalue(c10::IValue(d));
  } else if (v.isBoolList()) {
    add(9);
    for (bool b : v.toBoolList()) add(b);
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
    for (const auto& e : v.toListRef()) add_ivalue(e);
  } else if (const auto* p = ir::partition_of(v)) {
    add(12);  // a compiled partition: its outputs depend on it alone
    add(static_cast<int64_t>(p->id));
  } else {
    cacheable = false;
  }
}

const MetaResult* meta_cache_find(const std::string& key) {
  auto& c = cache();
  auto it = c.map.find(key);
  return it == c.map.end() ? nullptr : &it->second;
}

void meta_cache_put(std::string key, MetaResult result) {
  auto& c = cache();
  if (c.map.size() >= kMaxEntries) c.map.clear();  // bounded: a shape-churning loop must not grow memory
  c.map.emplace(std::move(key), std::move(result));
}


} // namespace torch_mgpu::capture
