// Pointwise fusion in C++: which nodes form a group, which of their results
// are materialized, and that a group never needs a value that depends on
// itself (a path that leaves the group on another lane and comes back).
#include "capture/lazy_tensor.h"
#include "ir/graph.h"
#include "plan/fusion.h"
#include "plan/plan.h"
#include "runtime/executor.h"

#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include <gtest/gtest.h>

#include <vector>

namespace {

using namespace torch_mgpu;

int index_of(const ir::Graph& g, const at::Tensor& t) {
  return g.find(capture::buffer_of(t)->value.node.get());
}

at::Tensor result(const runtime::ExecResult& r, const ir::Graph& g, const at::Tensor& t) {
  const int i = index_of(g, t);
  return runtime::cpu_view(r.values[i][capture::buffer_of(t)->value.index], capture::geometry_of(t));
}

ir::Graph graph_of(const std::vector<at::Tensor>& roots) {
  std::vector<ir::Value> values;
  for (const auto& t : roots) values.push_back(capture::buffer_of(t)->value);
  return ir::build_graph(values);
}

TEST(Fusion, ChainKeepsOnlyWhatIsReadElsewhere) {
  torch::manual_seed(3);
  auto x = torch::randn({300});
  auto xm = x.to(torch_mgpu::device());
  auto a = xm * 2;
  auto b = a + 1;
  auto c = b * b;
  auto d = torch::sigmoid(b);  // reads b outside the run
  ir::Graph g = graph_of({c, d});
  auto topo = plan::make_topology({"cpu"}, 1, at::get_num_threads());
  plan::Plan p = plan::make_serial_plan(g, topo, plan::CostModel());
  p.fusion = plan::fuse(g, p.lane_order);
  ASSERT_EQ(p.fusion.groups.size(), 1u);
  const auto& grp = p.fusion.groups[0];
  ASSERT_EQ(grp.steps.size(), 3u);
  EXPECT_EQ(grp.steps[0].node, index_of(g, a));
  EXPECT_FALSE(grp.steps[0].materialize);  // a: read only by b
  EXPECT_TRUE(grp.steps[1].materialize);   // b: read by sigmoid
  EXPECT_TRUE(grp.steps[2].materialize);   // c: a root
  EXPECT_EQ(grp.slots, 1);
  EXPECT_EQ(grp.externals.size(), 1u);     // x
  EXPECT_EQ(p.fusion.group_at[index_of(g, a)], 0);
  EXPECT_EQ(p.fusion.group_of[index_of(g, d)], -1);

  runtime::ExecResult r = runtime::execute(g, p, {runtime::Place()});
  ASSERT_FALSE(r.first_error);
  EXPECT_TRUE(torch::equal(result(r, g, c), (x * 2 + 1) * (x * 2 + 1)));
  EXPECT_TRUE(torch::equal(result(r, g, d), torch::sigmoid(x * 2 + 1)));
}

TEST(Fusion, NoGroupLeavesAndComesBack) {
  torch::manual_seed(4);
  auto x = torch::randn({64});
  auto xm = x.to(torch_mgpu::device());
  auto m1 = xm * 2;
  auto t = torch::sigmoid(m1);
  auto y = t * 3;
  auto m2 = m1 + y;  // reads m1 directly and through sigmoid on another lane
  ir::Graph g = graph_of({m2});
  ASSERT_EQ(g.size(), 4u);
  auto topo = plan::make_topology({"cpu"}, 2, at::get_num_threads());
  plan::Plan p = plan::make_serial_plan(g, topo, plan::CostModel());
  const int i1 = index_of(g, m1), it = index_of(g, t), iy = index_of(g, y), i2 = index_of(g, m2);
  p.lane_order = {{i1, i2}, {it, iy}};
  p.lane_of[i1] = p.lane_of[i2] = 0;
  p.lane_of[it] = p.lane_of[iy] = 1;
  p.lanes_used = 2;
  plan::compute_reuse(g, p);
  p.fusion = plan::fuse(g, p.lane_order);
  // m1 and m2 follow each other on lane 0, but m2 needs y, which needs m1:
  // one pass over both would wait for itself.
  EXPECT_TRUE(p.fusion.groups.empty());
  runtime::ExecResult r = runtime::execute(g, p, {runtime::Place(), runtime::Place()});
  ASSERT_FALSE(r.first_error);
  EXPECT_TRUE(torch::equal(result(r, g, m2), x * 2 + torch::sigmoid(x * 2) * 3));
}

TEST(Fusion, GroupReadsAnotherLanesResult) {
  torch::manual_seed(5);
  auto x = torch::randn({5000});
  auto xm = x.to(torch_mgpu::device());
  auto s = torch::sigmoid(xm);     // lane 1
  auto a = xm * 0.5;               // lane 0: a, b, c one pass
  auto b = a - 2;
  auto c = s * b;                  // reads lane 1's result (earlier in topological order)
  ir::Graph g = graph_of({c});
  auto topo = plan::make_topology({"cpu"}, 2, at::get_num_threads());
  plan::Plan p = plan::make_serial_plan(g, topo, plan::CostModel());
  const int is = index_of(g, s), ia = index_of(g, a), ib = index_of(g, b), ic = index_of(g, c);
  ASSERT_LT(is, ia);
  p.lane_order = {{ia, ib, ic}, {is}};
  p.lane_of[ia] = p.lane_of[ib] = p.lane_of[ic] = 0;
  p.lane_of[is] = 1;
  p.lanes_used = 2;
  plan::compute_reuse(g, p);
  p.fusion = plan::fuse(g, p.lane_order);
  ASSERT_EQ(p.fusion.groups.size(), 1u);
  EXPECT_EQ(p.fusion.groups[0].steps.size(), 3u);
  runtime::ExecResult r = runtime::execute(g, p, {runtime::Place(), runtime::Place()});
  ASSERT_FALSE(r.first_error);
  EXPECT_TRUE(torch::equal(result(r, g, c), torch::sigmoid(x) * (x * 0.5 - 2)));
}

} // namespace
