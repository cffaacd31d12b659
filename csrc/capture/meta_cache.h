#pragma once
// Shape inference results, cached per op and input signature. Running an op
// on Meta tensors costs microseconds; a training step repeats the same calls,
// so the second step on reads geometry from here.
#include "ir/node.h"

#include <c10/util/Exception.h>

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
};

// Key builder: append the parts of a call's signature.
struct SignatureKey {
  std::string bytes;
  bool cacheable = true;
  void add(int64_t v) { bytes.append(reinterpret_cast<const char*>(&v), sizeof v); }
  void add_geometry(const ir::TensorGeometry& g);
  void add_ivalue(const c10::IValue& v);
};

// `key` starts with the operator (its schema's address), then its arguments.
const MetaResult* meta_cache_find(const std::string& key);
void meta_cache_put(std::string key, MetaResult result);

} // namespace torch_mgpu::capture
