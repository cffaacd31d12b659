#include "ir/node.h"
#include "ir/fork_order.h"
#include "ir/held_bytes.h"
#include "ir/partition.h"

#include <pthread.h>

#include <mutex>
#include <new>
#include <unordered_set>

#include <cstring>
#include <functional>

namespace torch_mgpu::ir {

namespace {
std::atomic<int64_t> g_pending{0};
std::atomic<uint64_t> g_next_id{0};

uint64_t hash_bytes(const void* p, size_t n) {
  // FNV-1a: stable across runs, unlike std::hash on some types.
  uint64_t h = 1469598103934665603ull;
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) {
    h ^= b[i];
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t hash_geometry(uint64_t h, const TensorGeometry& g) {
  h = hash_combine(h, static_cast<uint64_t>(g.dtype));
  for (auto s : g.sizes) h = hash_combine(h, static_cast<uint64_t>(s));
  h = hash_combine(h, 0x5151);
  for (auto s : g.strides) h = hash_combine(h, static_cast<uint64_t>(s));
  h = hash_combine(h, static_cast<uint64_t>(g.offset));
  return hash_combine(h, static_cast<uint64_t>(g.conj) * 2 + static_cast<uint64_t>(g.neg));
}
} // namespace

uint64_t hash_combine(uint64_t seed, uint64_t value) {
  return seed ^ (value + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2));
}

uint64_t hash_ivalue(const c10::IValue& v) {
  if (v.isNone()) return 0x11;
  if (v.isBool()) return hash_combine(0x12, v.toBool());
  if (v.isInt()) return hash_combine(0x13, static_cast<uint64_t>(v.toInt()));
  if (v.isDouble()) {
    const double d = v.toDouble();
    return hash_combine(0x14, d == 0.0 ? 0 : d == 1.0 ? 1 : 2);
  }
  if (v.isString()) {
    const auto& s = v.toStringRef();
    return hash_combine(0x15, hash_bytes(s.data(), s.size()));
  }
  if (v.isDevice()) {
    return hash_combine(0x16, std::hash<c10::Device>()(v.toDevice()));
  }
  if (v.isList()) {
    uint64_t h = 0x17;
    for (const auto& e : v.toListRef()) h = hash_combine(h, hash_ivalue(e));
    return h;
  }
  if (v.isTensor()) {
    // Tensor constants (snapshots of CPU inputs) hash by shape and dtype:
    // data does not change a plan.
    const auto& t = v.toTensor();
    uint64_t h = hash_combine(0x18, static_cast<uint64_t>(t.scalar_type()));
    for (auto s : t.sizes()) h = hash_combine(h, static_cast<uint64_t>(s));
    return h;
  }
  if (v.isGenerator()) return 0x19;
  // A compiled partition: by its unique id (two partitions never share
  // output shapes or a plan by accident).
  if (const auto* p = partition_of(v)) return hash_combine(0x1a, p->id);
  if (v.isScalar()) {
    auto s = v.toScalar();
    if (s.isComplex()) {
      auto c = s.toComplexDouble();
      return hash_combine(hash_ivalue(c10::IValue(c.real())), hash_ivalue(c10::IValue(c.imag())));
    }
    if (s.isFloatingPoint()) return hash_ivalue(c10::IValue(s.toDouble()));
    if (s.isBoolean()) return hash_ivalue(c10::IValue(s.toBool()));
    return hash_ivalue(c10::IValue(s.toLong()));
  }
  return hash_combine(0x1f, hash_bytes(v.tagKind().data(), v.tagKind().size()));
}

c10::Storage Node::replica(c10::Device device) const {
  std::lock_guard<std::mutex> lock(replicas_mutex_);
  for (const auto& r : replicas_)
    if (r.device() == device) return r;
  return {};
}

void Node::add_replica(c10::Storage copy) const {
  hold(copy);
  std::lock_guard<std::mutex> lock(replicas_mutex_);
  replicas_.push_back(std::move(copy));
}

namespace {
std::mutex& replica_making_mutex() {
  static auto* m = [] {
    auto* made = new std::mutex();  // leaked: nodes die during exit
    // A flight's lane may hold it when the program forks: the child must
    // not inherit it locked.
    on_fork(ForkRank::Registry, [] { replica_making_mutex().lock(); }, [] { replica_making_mutex().unlock(); },
                   [] { replica_making_mutex().unlock(); });
    return made;
  }();
  return *m;
}
} // namespace

c10::Storage Node::replica_or(c10::Device device,
                              const std::function<c10::Storage(const c10::Storage* any)>& make) const {
  // Rare (first reads of Empty values, copies of data to a device), so one
  // lock for all nodes; `make` takes only leaf locks (the host cache's).
  std::lock_guard<std::mutex> make_one(replica_making_mutex());
  if (auto r = replica(device)) return r;
  std::optional<c10::Storage> any;
  {
    std::lock_guard<std::mutex> lock(replicas_mutex_);
    if (!replicas_.empty()) any = replicas_.front();
  }
  c10::Storage made = make(any ? &*any : nullptr);
  add_replica(made);
  return made;
}

std::vector<c10::Storage> Node::replicas() const {
  std::lock_guard<std::mutex> lock(replicas_mutex_);
  return replicas_;
}

Node::Node() : id(g_next_id.fetch_add(1)) {
  g_pending.fetch_add(1);
}

Node::~Node() {
  if (kind == NodeKind::Op) g_pending.fetch_sub(1);
  release(data);
  for (const auto& r : replicas_) release(r);
  // Release long operand chains iteratively: a chain of a million in-place
  // versions would otherwise recurse a million frames deep on destruction.
  // A node this one held last is emptied of its operands before it dies;
  // `next` carries a chain with no allocation, `stack` the branches.
  NodePtr next;
  std::vector<NodePtr> stack;
  auto take = [&](c10::SmallVectorImpl<Value>& ops) {
    for (auto& v : ops) {
      if (!v.node || v.node.use_count() != 1) continue;
      if (!next) next = std::move(v.node);
      else stack.push_back(std::move(v.node));
    }
    ops.clear();
  };
  take(operands);
  while (next || !stack.empty()) {
    NodePtr n;
    if (next) {
      n = std::move(next);
      next.reset();
    } else {
      n = std::move(stack.back());
      stack.pop_back();
    }
    take(n->operands);
  }
}

void mark_executed(Node& node) {
  if (node.kind == NodeKind::Op) {
    node.kind = NodeKind::Data;  // its results now live with the executor
    g_pending.fetch_sub(1);
  }
}

int64_t pending_op_count() { return g_pending.load(); }
uint64_t next_node_id() { return g_next_id.load(); }

std::string_view intern(std::string_view s) {
  static std::mutex m;
  static auto* strings = new std::unordered_set<std::string>();  // leaked: views outlive statics
  std::lock_guard<std::mutex> lock(m);
  return *strings->emplace(s).first;
}

uint64_t Node::hash_prefix() const {
  uint64_t h = hash_bytes(name.data(), name.size());
  if (kind != NodeKind::Op) return hash_combine(h, outputs.empty() ? 0 : outputs[0].nbytes);
  for (const auto& a : args) {
    h = hash_combine(h, static_cast<uint64_t>(a.kind));
    if (a.kind == Arg::Kind::Constant) {
      h = hash_combine(h, hash_ivalue(a.constant));
    } else {
      for (const auto& t : a.tensors) {
        if (!t) {
          h = hash_combine(h, 0x77);
          continue;
        }
        h = hash_combine(h, static_cast<uint64_t>(t->operand));
        h = hash_geometry(h, t->geom);
      }
    }
  }
  for (const auto& o : outputs) {
    h = hash_combine(h, o.nbytes);
    h = hash_combine(h, static_cast<uint64_t>(o.mutated_operand + 1));
  }
  return h;
}

uint64_t Node::hash_from_prefix(uint64_t prefix) const {
  if (hash_) return *hash_;
  uint64_t h = prefix;
  // Which output of its producer each operand is (the producers' own
  // hashes are the graph hash's: here, iteration would not survive deep chains).
  if (kind == NodeKind::Op)
    for (const auto& v : operands) h = hash_combine(h, static_cast<uint64_t>(v.index));
  hash_ = h;
  return h;
}

uint64_t Node::hash() const {
  if (hash_) return *hash_;
  return hash_from_prefix(hash_prefix());
}

namespace {
// Blocks of one size, kept for reuse when freed (up to kKept of them; more
// go back to the allocator). A node is made on the recording thread and
// freed wherever its last reference drops (a lane, a sync, Python's
// collector): one small lock guards the list, a fixed array (giving a block
// back never allocates: it runs inside shared_ptr's noexcept release).
class BlockPool {
 public:
  explicit BlockPool(size_t size) : size_(size) {}
  void* take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (count_ > 0) return free_[--count_];
    }
    return ::operator new(size_);
  }
  void give(void* p) noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (count_ < kKept) {
        free_[count_++] = p;
        return;
      }
    }
    ::operator delete(p);
  }
  // In a fork() child, which has only the forking thread: the list
  // (perhaps mid-change in another thread of the parent) is given up,
  // leaked, and the lock made anew. No prepare handler: one holding this
  // lock would wait beside the handlers that wait for other threads' work.
  void reset_in_child() {
    new (&mutex_) std::mutex();
    count_ = 0;
  }

 private:
  static constexpr size_t kKept = 1024;
  const size_t size_;
  std::mutex mutex_;
  size_t count_ = 0;
  void* free_[kKept];
};

// std::allocate_shared's allocator: the control block and the node in one
// block from the pool (one pool per block type; leaked, as nodes may die
// during exit).
template <class T>
struct PoolAllocator {
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__, "pool blocks have operator new's alignment");
  using value_type = T;
  PoolAllocator() = default;
  template <class U>
  PoolAllocator(const PoolAllocator<U>&) {}
  static BlockPool& pool() {
    static BlockPool* p = [] {
      auto* made = new BlockPool(sizeof(T));
      on_fork(ForkRank::ChildOnly, nullptr, nullptr, [] { pool().reset_in_child(); });
      return made;
    }();
    return *p;
  }
  T* allocate(size_t n) {
    if (n != 1) {
      if (n > static_cast<size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
      return static_cast<T*>(::operator new(n * sizeof(T)));
    }
    return static_cast<T*>(pool().take());
  }
  void deallocate(T* p, size_t n) {
    if (n != 1) ::operator delete(p);
    else pool().give(p);
  }
  template <class U>
  bool operator==(const PoolAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const PoolAllocator<U>&) const { return false; }
};
} // namespace

NodePtr new_node() { return std::allocate_shared<Node>(PoolAllocator<Node>()); }

namespace {
// A leaf: not an op, never pending, one output of `nbytes`.
NodePtr make_leaf(NodeKind kind, const char* name, size_t nbytes) {
  auto n = new_node();
  n->kind = kind;
  g_pending.fetch_sub(1);  // constructed counting as a pending op
  n->name = name;
  Output o;
  o.nbytes = nbytes;
  n->outputs.push_back(o);
  return n;
}
} // namespace

NodePtr make_data(c10::Storage storage) {
  auto n = make_leaf(NodeKind::Data, "data", storage.nbytes());
  n->data = std::move(storage);
  hold(n->data);
  return n;
}

NodePtr make_empty(size_t nbytes) { return make_leaf(NodeKind::Empty, "empty", nbytes); }

NodePtr make_error(std::string message, size_t nbytes) {
  auto n = make_leaf(NodeKind::Error, "error", nbytes);
  n->error = std::move(message);
  return n;
}

} // namespace torch_mgpu::ir
