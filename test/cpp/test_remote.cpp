// Nodes as bytes (runtime/serialize.h): what a worker rank reads back runs
// as the node it was written from, and malformed bytes raise; plans keep
// what cannot be sent on this process.
#include "capture/lazy_tensor.h"
#include "engine/plan_cache.h"
#include "ir/graph.h"
#include "ir/node.h"
#include "runtime/run_node.h"
#include "runtime/serialize.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <gtest/gtest.h>

namespace {

using namespace torch_mgpu;
using capture::geometry_of;

ir::Arg tensor_arg(int operand, const at::Tensor& t) {
  ir::Arg a;
  a.kind = ir::Arg::Kind::Tensor;
  a.tensors.emplace_back(ir::TensorRef{operand, geometry_of(t), -1});
  return a;
}

ir::Arg constant(c10::IValue v) {
  ir::Arg a;
  a.constant = std::move(v);
  return a;
}

// out = op(args...) as a node over `operands`, one fresh output like `like`.
ir::NodePtr make_node(const char* name, const char* overload, std::vector<ir::Arg> args, const at::Tensor& like,
                      const std::vector<at::Tensor>& inputs = {}) {
  auto n = std::make_shared<ir::Node>();
  for (const auto& t : inputs) n->operands.push_back(ir::Value{ir::make_data(t.storage()), 0});
  n->op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  n->name = ir::intern(std::string(name) + (*overload ? std::string(".") + overload : std::string()));
  for (auto& a : args) n->args.push_back(std::move(a));
  ir::Output o;
  o.nbytes = like.nbytes();
  o.returned = 0;
  o.geom = geometry_of(like);
  n->outputs.push_back(o);
  n->where = ir::intern("model.py:3");
  return n;
}

// Written as structure and values, read back, its values filled in.
ir::NodePtr round_trip(const ir::Node& n) {
  runtime::Writer w, values;
  runtime::write_node(w, values, n);
  runtime::Reader r(w.bytes()), rv(values.bytes());
  std::vector<int> holes;
  auto back = runtime::read_node(r, holes);
  runtime::patch_node(*back, holes, rv);
  EXPECT_TRUE(r.done());
  EXPECT_TRUE(rv.done());
  return back;
}

at::Tensor run(const ir::Node& n, const std::vector<at::Tensor>& inputs) {
  std::vector<c10::Storage> operands;
  for (const auto& t : inputs) operands.push_back(t.storage());
  auto out = runtime::run_node(n, operands, std::vector<bool>(inputs.size(), false));
  return runtime::cpu_view(out.at(0), n.outputs[0].geom);
}

TEST(Remote, NodeReadBackRunsAsWritten) {
  auto a = torch::randn({3, 4}).t();  // a strided view
  auto b = torch::randn({4, 3});
  auto n = make_node("aten::add", "Tensor", {tensor_arg(0, a), tensor_arg(1, b), constant(c10::Scalar(0.25))},
                     torch::empty({4, 3}), {a, b});
  n->seed = 1234;
  n->state.matmul_precision = 1;
  auto back = round_trip(*n);
  EXPECT_EQ(back->name, n->name);
  EXPECT_EQ(back->where, n->where);
  EXPECT_EQ(*back->seed, 1234u);
  EXPECT_EQ(back->state, n->state);
  ASSERT_EQ(back->args.size(), 3u);
  EXPECT_EQ(back->args[0].tensors[0]->geom, n->args[0].tensors[0]->geom);
  EXPECT_EQ(back->outputs[0].geom, n->outputs[0].geom);
  EXPECT_TRUE(torch::equal(run(*back, {a, b}), a + 0.25 * b));
}

TEST(Remote, AStructureKeptByAWorkerRunsWithEachRunsValues) {
  // The same program with another learning rate and seed: the structure
  // is byte for byte the same, the values are not.
  auto a = torch::randn({5});
  auto b = torch::randn({5});
  auto n = make_node("aten::add", "Tensor", {tensor_arg(0, a), tensor_arg(1, b), constant(c10::Scalar(0.5))},
                     torch::empty({5}), {a, b});
  n->seed = 1;
  auto m = make_node("aten::add", "Tensor", {tensor_arg(0, a), tensor_arg(1, b), constant(c10::Scalar(-3.0))},
                     torch::empty({5}), {a, b});
  m->seed = 2;
  runtime::Writer wn, vn, wm, vm;
  runtime::write_node(wn, vn, *n);
  runtime::write_node(wm, vm, *m);
  EXPECT_EQ(wn.bytes(), wm.bytes());
  EXPECT_NE(vn.bytes(), vm.bytes());
  runtime::Reader r(wn.bytes());
  std::vector<int> holes;
  auto kept = runtime::read_node(r, holes);
  EXPECT_EQ(holes, std::vector<int>{2});
  for (auto* values : {&vn, &vm, &vn}) {
    runtime::Reader rv(values->bytes());
    runtime::patch_node(*kept, holes, rv);
    const double alpha = values == &vn ? 0.5 : -3.0;
    EXPECT_EQ(*kept->seed, values == &vn ? 1u : 2u);
    EXPECT_TRUE(torch::equal(run(*kept, {a, b}), torch::add(a, b, alpha)));
  }
}

TEST(Remote, ConstantsOfEveryPlainKindCross) {
  auto x = torch::randn({2, 6});
  // sum.dim_IntList(self, int[1]? dim, bool keepdim, ScalarType? dtype)
  auto n = make_node("aten::sum", "dim_IntList",
                     {tensor_arg(0, x), constant(c10::IValue(std::vector<int64_t>{1})), constant(true),
                      constant(c10::IValue(static_cast<int64_t>(at::kDouble)))},
                     torch::empty({2, 1}, torch::kDouble), {x});
  EXPECT_TRUE(torch::equal(run(*round_trip(*n), {x}), x.sum({1}, true, at::kDouble)));
  // A seeded CPU generator crosses as its state: the same draws.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  auto like = torch::empty({5});
  auto r = make_node("aten::normal", "float_float",
                     {constant(0.0), constant(1.0), constant(c10::IValue(std::vector<int64_t>{5})),
                      constant(c10::IValue(gen)), constant(c10::IValue()), constant(c10::IValue()),
                      constant(c10::IValue()), constant(c10::IValue())},
                     like);
  auto g2 = at::make_generator<at::CPUGeneratorImpl>(77);
  EXPECT_TRUE(torch::equal(run(*round_trip(*r), {}), at::normal(0.0, 1.0, {5}, g2)));
  // A host tensor constant crosses by value.
  auto t = torch::tensor({1.5, -2.0});
  auto one = torch::ones({2}, torch::kDouble);
  auto c = make_node("aten::mul", "Tensor", {tensor_arg(0, one), constant(t)}, torch::empty({2}, torch::kDouble),
                     {one});
  EXPECT_TRUE(torch::equal(run(*round_trip(*c), {one}), one * t));
}

TEST(Remote, MalformedBytesRaise) {
  auto x = torch::randn({3});
  auto n = make_node("aten::relu", "", {tensor_arg(0, x)}, torch::empty({3}), {x});
  runtime::Writer w, values;
  runtime::write_node(w, values, *n);
  const std::string& bytes = w.bytes();
  std::vector<int> holes;
  for (size_t cut : {size_t(0), size_t(5), bytes.size() / 2, bytes.size() - 1}) {
    runtime::Reader r(bytes.data(), cut);
    EXPECT_THROW(runtime::read_node(r, holes), c10::Error) << cut;
  }
  // An operator this process lacks.
  runtime::Writer bad;
  bad.put_string("aten::no_such_op.x");
  runtime::Reader r(bad.bytes());
  try {
    runtime::read_node(r, holes);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist in this process"), std::string::npos);
  }
}

TEST(Remote, ANodeWithACustomClassConstantIsNotSerializable) {
  auto x = torch::randn({3});
  auto n = make_node("aten::relu", "", {tensor_arg(0, x)}, torch::empty({3}), {x});
  EXPECT_TRUE(runtime::serializable(*n));
  n->args.push_back(constant(c10::IValue(c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get()))));
  EXPECT_FALSE(runtime::serializable(*n));
}

// Plans with lanes on other ranks keep a node that cannot be sent on this
// process's lanes, wherever list scheduling put it, and its plan stays
// whole: every node once, in the order of the lane it is on.
TEST(Remote, PlansKeepANodeThatCannotBeSentOnThisProcess) {
  const auto topo = plan::make_topology({"cpu", "rank1:cpu"}, 1, 2);
  plan::CostModel cm;
  cm.network_latency_s = 1e-6;  // crossings are cheap: work spreads over both ranks
  std::vector<ir::Value> roots;
  std::vector<ir::NodePtr> unsendable;
  for (int k = 0; k < 8; ++k) {
    auto x = torch::randn({384, 384});
    auto n = make_node("aten::mm", "", {tensor_arg(0, x), tensor_arg(1, x)}, torch::empty({384, 384}), {x, x});
    if (k == 1 || k == 2) {
      n->args.push_back(constant(c10::IValue(c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get()))));
      unsendable.push_back(n);
    }
    roots.push_back(ir::Value{n, 0});
  }
  const auto g = ir::build_graph(roots);
  ASSERT_EQ(g.size(), 8u);
  const auto p = engine::make_plan_for(g, topo, cm, "heft", false);
  // List scheduling alone puts one of them there.
  const auto raw = plan::make_plan(g, topo, cm, "heft", false);
  int moved = 0;
  for (const auto& n : unsendable) moved += topo.lanes[raw.lane_of[g.find(n.get())]].rank != 0;
  EXPECT_GT(moved, 0);
  int there = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const bool sendable = runtime::serializable(*g.nodes[i]);
    if (topo.lanes[p.lane_of[i]].rank != 0) {
      ++there;
      EXPECT_TRUE(sendable) << "node " << i << " cannot be sent, and was planned on rank 1";
    }
  }
  EXPECT_GT(there, 0) << "the sendable products were not spread to rank 1";
  for (const auto& n : unsendable) EXPECT_EQ(topo.lanes[p.lane_of[g.find(n.get())]].rank, 0);
  std::vector<int> seen(g.size(), 0);
  for (size_t l = 0; l < p.lane_order.size(); ++l)
    for (int i : p.lane_order[l]) {
      EXPECT_EQ(p.lane_of[i], static_cast<int>(l));
      ++seen[i];
    }
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(seen[i], 1) << "node " << i;
}

// When every node is kept here, the plan is a one-lane plan again: it says
// so, and its lane gets the threads a one-lane plan has (the executor runs
// it on the syncing thread with them), not half of them.
TEST(Remote, APlanWhoseNodesAllStayHereIsAOneLanePlan) {
  auto topo = plan::make_topology({"cpu", "rank1:cpu"}, 1, 2);
  topo.caller_threads = 2;
  plan::CostModel cm;
  cm.network_latency_s = 1e-6;
  std::vector<ir::Value> roots;
  for (int k = 0; k < 6; ++k) {
    auto x = torch::randn({384, 384});
    auto n = make_node("aten::mm", "", {tensor_arg(0, x), tensor_arg(1, x)}, torch::empty({384, 384}), {x, x});
    n->args.push_back(constant(c10::IValue(c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get()))));
    roots.push_back(ir::Value{n, 0});
  }
  const auto g = ir::build_graph(roots);
  const auto raw = plan::make_plan(g, topo, cm, "heft", false);
  ASSERT_EQ(raw.lanes_used, 2) << "list scheduling spreads the products";
  const auto p = engine::make_plan_for(g, topo, cm, "heft", false);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(p.lane_of[i], 0);
  EXPECT_EQ(p.lanes_used, 1);
  EXPECT_EQ(p.threads_per_lane, topo.one_lane_threads());
  EXPECT_EQ(p.threads_per_lane, 2);
}

} // namespace
