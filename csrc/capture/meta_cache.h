#pragma once
// Shape inference results, cached per op and input signature. Running an op
// on Meta tensors costs microseconds; a training step repeats the same calls,
// so the second step on reads geometry from here.
#include "ir/node.h"

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <optional>

#include <string>
#include <vector>

namespace torch_mgpu::capture {

struct MetaReturn {
  enum class Kind : uint8_t { Tensor, TensorList, None, Undefined };
  Kind kind = Kind::Tensor;
  int count = 1;  // lists: element count
};

struct MetaTensor {
  bool defined = true;
  int alias = -1;  // index of the input storage it views, -1 when fresh
  ir::TensorGeometry geom;
  size_t nbytes = 0;  // fresh outputs: storage bytes
};

struct MetaResult {
  std::vector<MetaReturn> returns;
  std::vector<MetaTensor> tensors;  // the returned tensors, flattened
  // Mutated tensor slots after the op: geometry and their storage's bytes
  // (out= and resize_ change them).
  std::vector<ir::TensorGeometry> mutated_geom;
  std::vector<size_t> mutated_nbytes;
  // ATen's out= resize warnings, given at each call with this signature.
  std::vector<c10::Warning> resize_warnings;
  // The hash of the node this signature records, operands aside
  // (ir::Node::hash_prefix: the op, its constants' classes and geometries,
  // its outputs: all fixed by the signature), once a call has made it.
  mutable std::optional<uint64_t> node_hash_prefix;
};

// Key builder: append the parts of a call's signature, as 64-bit words.
// Built on every recorded call: held inline (a call's key is a few dozen
// words), so building it allocates nothing.
struct SignatureKey {
  c10::SmallVector<int64_t, 64> words;
  bool cacheable = true;
  void add(int64_t v) { words.push_back(v); }
  void add_geometry(const ir::TensorGeometry& g);
  void add_ivalue(const c10::IValue& v);
  // A float that only scales a term: by its class (0, 1, other), as the
  // node hash keys floats.
  void add_scale(double d);
  uint64_t hash() const;
};

// The entry an operator's last call found: its next call, in a loop, most
// often has the same signature, which then needs no hashing. Guarded, with
// the cache, by the state lock.
struct MetaCacheMemo {
  const void* entry = nullptr;
  uint64_t generation = 0;  // the cache's when `entry` was found (a clear makes it stale)
};

// `key` starts with the operator (its schema's address), then its arguments.
const MetaResult* meta_cache_find(const SignatureKey& key, MetaCacheMemo* memo = nullptr);
void meta_cache_put(const SignatureKey& key, MetaResult result);

} // namespace torch_mgpu::capture
