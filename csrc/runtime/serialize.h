#pragma once
// A node as bytes, for a lane in another process (runtime/remote.h): its
// operator's schema name, its argument template (constants and tensor
// views of its operands), its outputs, seed and call state. Only data: the
// reader looks the operator up in its own dispatcher by name and runs
// nothing it receives as code. Constants are plain values (numbers,
// strings, devices, lists and tuples of them, host tensors); a node with
// anything else (a Generator, a custom class) is not serializable and
// runs in the controller's process.
#include "ir/node.h"

#include <cstring>
#include <string>
#include <string_view>

namespace torch_mgpu::runtime {

using namespace ir;

// Appends plain values to a byte string.
class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put_bytes(const void* p, size_t n) {
    put<uint64_t>(n);
    out_.append(static_cast<const char*>(p), n);
  }
  void put_string(std::string_view s) { put_bytes(s.data(), s.size()); }
  std::string& bytes() { return out_; }

 private:
  std::string out_;
};

// Reads what a Writer wrote; running past the end raises.
class Reader {
 public:
  Reader(const char* p, size_t n) : p_(p), end_(p + n) {}
  explicit Reader(std::string_view s) : Reader(s.data(), s.size()) {}
  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  template <typename T>
  T peek() const {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    return v;
  }
  std::string_view get_bytes() {
    const auto n = get<uint64_t>();
    need(n);
    std::string_view s(p_, n);
    p_ += n;
    return s;
  }
  bool done() const { return p_ == end_; }
  size_t left() const { return static_cast<size_t>(end_ - p_); }

 private:
  void need(size_t n) const;
  const char* p_;
  const char* end_;
};

// Whether `n` can be written (see above).
bool serializable(const Node& n);
// Writes an Op node (everything but its operands' identities: the reader
// gets their bytes in order) in two parts: `w` its structure, the same
// each time the same program runs (a worker keeps it), `values` what may
// change from run to run (its id, seed, floating and tensor constants).
void write_node(Writer& w, Writer& values, const Node& n);
// A node read back from its structure, its operator looked up by name; it
// has no operands (run_node reads their bytes, not their Values). `holes`:
// its arguments whose values patch_node fills. Raises on malformed input or
// an operator this process does not have.
// `operands`: how many operands it was written with.
NodePtr read_node(Reader& r, std::vector<int>& holes, uint32_t* operands = nullptr);
// Fills in a node's run-to-run values (written to `values` by write_node).
void patch_node(Node& n, const std::vector<int>& holes, Reader& values);

void write_geometry(Writer& w, const TensorGeometry& g);
TensorGeometry read_geometry(Reader& r);

} // namespace torch_mgpu::runtime
