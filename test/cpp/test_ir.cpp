// The IR alone: nodes, values, hashing, graph building, printing. No op runs.
#include "ir/fork_order.h"
#include "ir/graph.h"
#include "ir/held_bytes.h"
#include "ir/lru.h"
#include "ir/trial.h"

#include <ATen/ATen.h>

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <random>
#include <string>
#include <thread>

using namespace torch_mgpu::ir;

namespace {

TensorGeometry geom(std::vector<int64_t> sizes) {
  TensorGeometry g;
  g.sizes.assign(sizes.begin(), sizes.end());
  g.strides.assign(sizes.size(), 1);
  for (int i = static_cast<int>(sizes.size()) - 2; i >= 0; --i) g.strides[i] = g.strides[i + 1] * sizes[i + 1];
  return g;
}

// A pending op node reading `inputs` (each as a whole tensor of `shape`).
NodePtr op(const std::string& name, std::vector<Value> inputs, std::vector<int64_t> shape = {4, 4},
           c10::IValue constant = c10::IValue(1.0)) {
  auto n = std::make_shared<Node>();
  n->name = intern(name);
  for (size_t k = 0; k < inputs.size(); ++k) {
    Arg a;
    a.kind = Arg::Kind::Tensor;
    a.tensors.push_back(TensorRef{static_cast<int>(k), geom(shape)});
    n->args.push_back(a);
    n->operands.push_back(inputs[k]);
  }
  Arg c;
  c.constant = constant;
  n->args.push_back(c);
  Output o;
  o.nbytes = 64;
  o.returned = 0;
  o.geom = geom(shape);
  n->outputs.push_back(o);
  return n;
}

Value v(NodePtr n) { return Value{std::move(n), 0}; }

Value leaf() {
  return v(make_empty(64));
}

} // namespace

TEST(Hash, EqualStructureHashesEqual) {
  auto x = leaf();
  auto add1 = op("aten::add", {x, x});
  auto add2 = op("aten::add", {x, x});
  auto add3 = op("aten::mul", {x, x});
  auto add4 = op("aten::add", {x, x}, {2, 8});
  auto add5 = op("aten::add", {x, x}, {4, 4}, c10::IValue(2.0));
  EXPECT_EQ(add1->hash(), add2->hash());
  EXPECT_NE(add1->hash(), add3->hash());
  EXPECT_NE(add1->hash(), add4->hash());
  EXPECT_NE(add1->hash(), add5->hash());
}

// A node's hash in two parts (capture keeps the first with the call's
// signature): the same whole, and the operands' output indices only in the
// second.
TEST(Hash, PrefixThenOperands) {
  auto two = std::make_shared<Node>();
  two->name = intern("aten::split");
  Output o;
  o.nbytes = 64;
  two->outputs.push_back(o);
  two->outputs.push_back(o);
  auto first = op("aten::add", {Value{two, 0}, Value{two, 0}});
  auto second = op("aten::add", {Value{two, 1}, Value{two, 0}});
  EXPECT_EQ(first->hash_prefix(), second->hash_prefix());
  auto again = op("aten::add", {Value{two, 0}, Value{two, 0}});
  EXPECT_EQ(again->hash_from_prefix(second->hash_prefix()), first->hash());
  EXPECT_NE(first->hash(), second->hash());
  auto fresh = op("aten::add", {Value{two, 1}, Value{two, 0}});
  EXPECT_EQ(fresh->hash_from_prefix(first->hash_prefix()), second->hash());
}

TEST(Hash, GraphHashSeesEdges) {
  auto x = leaf(), y = leaf();
  auto a = v(op("aten::mm", {x, y}));
  auto b = v(op("aten::relu", {a}));
  auto g1 = build_graph({b});
  // Same ops, but relu reads x directly: a different graph.
  auto a2 = v(op("aten::mm", {x, y}));
  auto b2 = v(op("aten::relu", {x}));
  auto g2 = build_graph({a2, b2});
  auto a3 = v(op("aten::mm", {x, y}));
  auto b3 = v(op("aten::relu", {a3}));
  auto g3 = build_graph({b3});
  EXPECT_EQ(g1.hash, g3.hash);
  EXPECT_NE(g1.hash, g2.hash);
}

// Which reads share a materialized value is structure: a cached plan lets a
// write reuse its operand's bytes where the writer is that value's one
// reader, so a graph where another node reads it too must not find that
// plan. Which values they are is not.
TEST(Hash, GraphHashSeesWhichReadsShareALeaf) {
  auto x = leaf(), y = leaf();
  auto shared = build_graph({v(op("aten::mul", {x})), v(op("aten::copy_", {x, y}))});
  auto apart = build_graph({v(op("aten::mul", {y})), v(op("aten::copy_", {x, y}))});
  auto z = leaf(), w = leaf();
  auto shared_again = build_graph({v(op("aten::mul", {z})), v(op("aten::copy_", {z, w}))});
  EXPECT_NE(shared.hash, apart.hash);
  EXPECT_EQ(shared.hash, shared_again.hash);
}

TEST(Graph, TopologicalOrderAndEdgesOnDiamond) {
  auto x = leaf();
  auto top = v(op("top", {x}));
  auto left = v(op("left", {top}));
  auto right = v(op("right", {top}));
  auto bottom = v(op("bottom", {left, right}));
  auto g = build_graph({bottom});
  ASSERT_EQ(g.size(), 4u);
  std::vector<int> pos(4);
  for (size_t i = 0; i < g.size(); ++i) {
    for (int d : g.deps[i]) EXPECT_LT(d, static_cast<int>(i));
  }
  EXPECT_EQ(g.nodes.front()->name, "top");
  EXPECT_EQ(g.nodes.back()->name, "bottom");
  EXPECT_EQ(g.deps.back().size(), 2u);
  EXPECT_EQ(g.users[0].size(), 2u);
}

TEST(Graph, OnlyPendingNodesAndDeepChains) {
  auto x = leaf();
  Value cur = x;
  for (int i = 0; i < 200000; ++i) cur = v(op("aten::add", {cur}));
  auto g = build_graph({cur});  // iterative: no stack overflow
  EXPECT_EQ(g.size(), 200000u);
  EXPECT_EQ(g.deps[0].size(), 0u);  // the Empty leaf is not a graph node
}

TEST(Graph, DeadBranchesFreedByReferenceCount) {
  int64_t before = pending_op_count();
  auto x = leaf();
  Value keep = v(op("keep", {x}));
  {
    Value dropped = v(op("dropped", {keep}));
    EXPECT_EQ(pending_op_count(), before + 2);
  }
  EXPECT_EQ(pending_op_count(), before + 1);
  auto g = build_graph({keep});
  EXPECT_EQ(g.size(), 1u);
  // Destroying a very long chain does not recurse.
  {
    Value cur = x;
    for (int i = 0; i < 300000; ++i) cur = v(op("aten::add", {cur}));
  }
  EXPECT_EQ(pending_op_count(), before + 1);
}

TEST(Graph, NodeIndexGrowsAndFindsEveryNode) {
  // Past several growths, with addresses that share their low bits.
  std::vector<Node> nodes(5000);
  NodeIndex index;
  for (size_t i = 0; i < nodes.size(); ++i) EXPECT_TRUE(index.insert(&nodes[i], static_cast<int>(i)));
  EXPECT_FALSE(index.insert(&nodes[17], 99));  // present: kept as it was
  EXPECT_EQ(index.size(), nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    const int* at = index.get(&nodes[i]);
    ASSERT_NE(at, nullptr);
    EXPECT_EQ(*at, static_cast<int>(i));
  }
  Node other;
  EXPECT_FALSE(index.contains(&other));
  EXPECT_FALSE(NodeIndex().contains(&other));
  // A graph's positions: every node at its own, a leaf nowhere.
  auto x = leaf();
  Value cur = x;
  for (int i = 0; i < 3000; ++i) cur = v(op("aten::add", {cur}));
  auto g = build_graph({cur});
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g.find(g.nodes[i].get()), static_cast<int>(i));
  EXPECT_EQ(g.find(x.node.get()), -1);
}

std::vector<int>& fork_steps() {
  static std::vector<int> steps;
  return steps;
}

TEST(Fork, HandlersRunByRankWhateverTheirRegistrationOrder) {
  // Registered leaf lock first, the wait last: pthread_atfork alone would
  // run the wait's prepare handler first and the lock's last.
  on_fork(ForkRank::HostCache, [] { fork_steps().push_back(31); }, [] { fork_steps().push_back(-31); },
          [] { fork_steps().push_back(131); });
  on_fork(ForkRank::Registry, [] { fork_steps().push_back(20); }, [] { fork_steps().push_back(-20); },
          [] { fork_steps().push_back(120); });
  on_fork(ForkRank::WaitForWork, [] { fork_steps().push_back(0); }, [] { fork_steps().push_back(-100); },
          [] { fork_steps().push_back(100); });
  fork_steps().clear();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) _exit(fork_steps() == std::vector<int>{0, 20, 31, 131, 120, 100} ? 0 : 1);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child's handlers ran out of order";
  EXPECT_EQ(fork_steps(), (std::vector<int>{0, 20, 31, -31, -20, -100}));
}

TEST(Graph, ExecutedNodesStopCounting) {
  int64_t before = pending_op_count();
  auto n = op("aten::relu", {leaf()});
  EXPECT_EQ(pending_op_count(), before + 1);
  mark_executed(*n);
  EXPECT_EQ(pending_op_count(), before);
  EXPECT_FALSE(n->is_pending());
}

TEST(Print, TextAndDot) {
  auto x = leaf();
  auto a = v(op("aten::mm", {x, x}));
  auto b = v(op("aten::relu", {a}));
  auto g = build_graph({b});
  auto text = to_text(g);
  EXPECT_NE(text.find("%0 = aten::mm("), std::string::npos);
  EXPECT_NE(text.find("%1 = aten::relu(%0)"), std::string::npos);
  auto dot = to_dot(g, {0, 1});
  EXPECT_NE(dot.find("digraph"), std::string::npos);
  EXPECT_NE(dot.find("n0 -> n1"), std::string::npos);
  EXPECT_NE(dot.find("lane 1"), std::string::npos);
}

TEST(Nodes, DataAndErrorAreNotPending) {
  auto e = make_error("boom", 8);
  EXPECT_FALSE(e->is_pending());
  EXPECT_EQ(e->error, "boom");
  auto em = make_empty(16);
  EXPECT_EQ(em->outputs[0].nbytes, 16u);
  EXPECT_FALSE(em->is_pending());
}

TEST(Nodes, BlocksAreReusedAcrossThreads) {
  // A node freed (here on another thread, as lanes free them) gives its
  // block to the next node made; each node made is a fresh one.
  auto a = new_node();
  a->name = intern("aten::first");
  const void* block = a.get();
  std::thread([n = std::move(a)]() mutable { n.reset(); }).join();
  auto b = new_node();
  EXPECT_EQ(static_cast<const void*>(b.get()), block);
  EXPECT_TRUE(b->name.empty());
  EXPECT_TRUE(b->args.empty() && b->outputs.empty());
  EXPECT_TRUE(b->is_pending());
  std::vector<NodePtr> many;
  for (int i = 0; i < 3000; ++i) many.push_back(new_node());  // more than are kept
  many.clear();
  auto c = new_node();
  EXPECT_NE(c, nullptr);
}

TEST(Hash, IValues) {
  EXPECT_EQ(hash_ivalue(c10::IValue(3)), hash_ivalue(c10::IValue(3)));
  EXPECT_NE(hash_ivalue(c10::IValue(3)), hash_ivalue(c10::IValue(4)));
  EXPECT_NE(hash_ivalue(c10::IValue(1.0)), hash_ivalue(c10::IValue(1)));
  EXPECT_EQ(hash_ivalue(c10::IValue(std::vector<int64_t>{1, 2})), hash_ivalue(c10::IValue(std::vector<int64_t>{1, 2})));
  EXPECT_NE(hash_ivalue(c10::IValue(std::vector<int64_t>{1, 2})), hash_ivalue(c10::IValue(std::vector<int64_t>{2, 1})));
  // Floating values by their class only: 0, 1, another value.
  EXPECT_EQ(hash_ivalue(c10::IValue(2.5)), hash_ivalue(c10::IValue(0.001)));
  EXPECT_EQ(hash_ivalue(c10::IValue(c10::Scalar(2.5))), hash_ivalue(c10::IValue(c10::Scalar(-7.0))));
  EXPECT_EQ(hash_ivalue(c10::IValue(std::vector<double>{0.9, 0.1})), hash_ivalue(c10::IValue(std::vector<double>{0.8, 0.3})));
  EXPECT_NE(hash_ivalue(c10::IValue(1.0)), hash_ivalue(c10::IValue(2.0)));
  EXPECT_NE(hash_ivalue(c10::IValue(0.0)), hash_ivalue(c10::IValue(2.0)));
  EXPECT_NE(hash_ivalue(c10::IValue(c10::complex<double>(1.0, 0.0))),
            hash_ivalue(c10::IValue(c10::complex<double>(2.0, 0.0))));
  EXPECT_EQ(hash_ivalue(c10::IValue(c10::complex<double>(2.0, 3.0))),
            hash_ivalue(c10::IValue(c10::complex<double>(4.0, -3.0))));
}

TEST(Lru, TheLeastRecentlyUsedGoesFirst) {
  Lru<int, std::string> c(2);
  c.get(1) = "one";
  c.get(2) = "two";
  ASSERT_NE(c.find(1), nullptr);  // 1 is now the more recent
  bool made = false;
  std::vector<int> gone;
  c.get(3, [](const std::string&) { return false; }, [&](int k, std::string&) { gone.push_back(k); }, &made) = "three";
  EXPECT_TRUE(made);
  EXPECT_EQ(gone, std::vector<int>{2});
  EXPECT_EQ(c.size(), 2u);
  EXPECT_EQ(*c.find(1), "one");
  EXPECT_EQ(c.find(2), nullptr);
  std::string* three = c.peek(3);  // peek does not count as a use: 3 stays the older
  ASSERT_NE(three, nullptr);
  c.get(4);
  EXPECT_EQ(c.find(3), nullptr);
  EXPECT_NE(c.find(1), nullptr);
  c.get(1, &made);
  EXPECT_FALSE(made);
}

TEST(Lru, KeptEntriesStayAndEntriesKeepTheirAddress) {
  Lru<int, int> c(2);
  int* first = &c.get(1);
  *first = 10;
  c.get(2) = 20;
  // Entry 1 is held on to (a graph being compiled): 2 goes instead, though more recent.
  c.get(3, [](const int& v) { return v == 10; }, [](int, int&) {}) = 30;
  EXPECT_EQ(c.find(1), first);
  EXPECT_EQ(c.find(2), nullptr);
  // Everything held on to: the cache grows past its capacity rather than drop one.
  c.get(4, [](const int&) { return true; }, [](int, int&) {});
  EXPECT_EQ(c.size(), 3u);
  c.erase(1);
  EXPECT_EQ(c.peek(1), nullptr);
  std::vector<int> order;
  c.for_each([&](int k, int&) { order.push_back(k); });
  EXPECT_EQ(order, (std::vector<int>{4, 3}));
  c.clear();
  EXPECT_EQ(c.size(), 0u);
}

TEST(Trial, WaysTakeTurnsColdFirstThenTheFastestBeyondTheMargin) {
  Trial t(1, 2, 1.05);  // the baseline, then two challengers
  t.add();
  t.add();
  // Challengers first (ties: the first), the baseline where it fell behind.
  EXPECT_EQ(t.turn(), 1u);
  EXPECT_FALSE(t.call(1));  // cold: not timed
  EXPECT_EQ(t.turn(), 2u);
  EXPECT_FALSE(t.call(2));
  EXPECT_EQ(t.turn(), 0u);
  EXPECT_FALSE(t.call(0));
  EXPECT_EQ(t.turn([](size_t j) { return j == 2; }), 2u);  // only way 2 may run
  EXPECT_EQ(t.turn([](size_t) { return false; }), 0u);     // none may: the baseline
  for (int k = 0; k < 2; ++k) {
    EXPECT_TRUE(t.call(1));
    t.record(1, 1.0);
    t.record(2, 0.5);
    t.record(0, 1.04);
  }
  EXPECT_TRUE(t.all_timed());
  EXPECT_EQ(t.fastest({1, 2}), 2u);
  EXPECT_EQ(t.choose(), 2u);      // 0.5 * 1.05 < 1.04
  EXPECT_EQ(t.choose({1}), 0u);   // 1.0 * 1.05 > 1.04: within the margin, the baseline stays
  t.drop(2);
  EXPECT_EQ(t.size(), 2u);
  EXPECT_EQ(t.choose(), 0u);
  t.record(0, 9.0, /*keep=*/2);  // the latest two kept
  EXPECT_EQ(t.seconds(0), (std::vector<double>{1.04, 9.0}));
  EXPECT_DOUBLE_EQ(median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_DOUBLE_EQ(median({}), 0.0);
}

// Held bytes count each storage once, however many hold it, through
// thousands of holds and releases in a random order (the registry's table
// grows and deletes by moving entries back: none may get lost).
TEST(HeldBytes, CountsEachStorageOnceThroughRandomHoldsAndReleases) {
  const HeldBytes before = held_bytes();
  std::mt19937 rng(7);
  std::vector<c10::Storage> storages;
  for (int i = 0; i < 3000; ++i)
    storages.push_back(at::empty({static_cast<int64_t>(1 + rng() % 200)}, at::kByte).storage());
  std::map<const c10::StorageImpl*, int> holders;
  auto expect_counts = [&] {
    int64_t bytes = 0, live = 0;
    for (const auto& s : storages)
      if (holders[s.unsafeGetStorageImpl()] > 0) {
        bytes += static_cast<int64_t>(s.nbytes());
        ++live;
      }
    const HeldBytes now = held_bytes();
    EXPECT_EQ(now.current - before.current, bytes);
    EXPECT_EQ(now.storages - before.storages, live);
  };
  for (int step = 0; step < 40000; ++step) {
    const auto& s = storages[rng() % storages.size()];
    int& h = holders[s.unsafeGetStorageImpl()];
    if (h > 0 && rng() % 2 == 0) {
      release(s);
      --h;
    } else {
      hold(s);
      ++h;
    }
    if (step % 5000 == 0) expect_counts();
  }
  expect_counts();
  for (const auto& s : storages)
    for (int& h = holders[s.unsafeGetStorageImpl()]; h > 0; --h) release(s);
  expect_counts();
  release(storages[0]);  // released more often than held: nothing changes
  expect_counts();
}

TEST(PointerMap, KeepsEveryKeyReachableThroughRandomInsertsAndErases) {
  // Erasing moves the slots after the hole back (no tombstones): a key
  // whose probe ran through the hole must still be found. Many keys, few
  // low-bit patterns, against std::map.
  std::vector<int> keys(4000);
  PointerMap<int, int64_t> m;
  std::map<const int*, int64_t> want;
  uint64_t r = 12345;
  auto next = [&] {
    r = r * 6364136223846793005ULL + 1442695040888963407ULL;
    return r >> 33;
  };
  for (int step = 0; step < 60000; ++step) {
    const int* k = &keys[next() % keys.size()];
    const auto v = static_cast<int64_t>(next());
    switch (next() % 3) {
      case 0:
        EXPECT_EQ(m.insert(k, v), want.emplace(k, v).second);
        break;
      case 1:
        m.get_or_make(k) += v;
        want[k] += v;
        break;
      default:
        m.erase(k);
        want.erase(k);
    }
  }
  EXPECT_EQ(m.size(), want.size());
  for (const int& k : keys) {
    const auto it = want.find(&k);
    const int64_t* got = m.get(&k);
    ASSERT_EQ(got != nullptr, it != want.end());
    if (got) EXPECT_EQ(*got, it->second);
  }
}
