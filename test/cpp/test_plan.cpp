// The planner's pieces that torch.compile's partitioner shares: the list
// schedule of tasks, and the work of an op described by its schema (as an
// op of an FX graph is) priced by the rules of recorded ops.
#include "capture/lazy_tensor.h"
#include "ir/graph.h"
#include "plan/groups.h"
#include "plan/pieces.h"
#include "plan/plan.h"
#include "plan/ranks.h"
#include "plan/cost_model.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace {

using namespace torch_mgpu;

const c10::FunctionSchema& schema_of(const char* name, const char* overload = "") {
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  EXPECT_TRUE(op.has_value()) << name;
  return op->schema();
}

ir::Arg tensor_arg(std::vector<int64_t> sizes) {
  ir::Arg a;
  a.kind = ir::Arg::Kind::Tensor;
  ir::TensorGeometry g;
  g.sizes.assign(sizes.begin(), sizes.end());
  int64_t stride = 1;
  g.strides.resize(sizes.size());
  for (size_t i = sizes.size(); i-- > 0;) {
    g.strides[i] = stride;
    stride *= sizes[i];
  }
  a.tensors.emplace_back(ir::TensorRef{0, g, -1});
  return a;
}

ir::Output output(std::vector<int64_t> sizes) {
  ir::Output o;
  o.geom = tensor_arg(sizes).tensors[0]->geom;
  double n = 1;
  for (auto s : sizes) n *= static_cast<double>(s);
  o.nbytes = static_cast<size_t>(n) * 4;
  return o;
}

TEST(Schedule, TasksAreListScheduledAsPlansAre) {
  // A diamond: b and c side by side after a, d after both.
  auto topo = plan::make_topology({"cpu"}, 2, 2);
  plan::CostModel cm;
  cm.lane_sync_s = 0.5;
  auto ts = plan::make_tasks({1, 2, 3, 1}, {{}, {0}, {0}, {1, 2}});
  auto s = plan::schedule_tasks(topo, cm, ts);
  // c (highest rank) stays on a's lane; b pays a cross-lane wait; d follows c.
  EXPECT_DOUBLE_EQ(s.makespan, 5.0);
  EXPECT_EQ(s.lane_of[0], s.lane_of[2]);
  EXPECT_NE(s.lane_of[1], s.lane_of[2]);
  EXPECT_DOUBLE_EQ(s.finish[1], 3.5);
  // One lane: the sum.
  auto one = plan::make_topology({"cpu"}, 1, 2);
  EXPECT_DOUBLE_EQ(plan::schedule_tasks(one, cm, ts).makespan, 7.0);
  EXPECT_THROW(plan::make_tasks({1, 1}, {{1}, {}}), c10::Error);
  EXPECT_THROW(plan::make_tasks({1, 1}, {{}}), c10::Error);
}

TEST(Pieces, PricesSumTheirNodesAndReadOtherPieces) {
  // 0 -> 1 -> 3, 0 -> 2 -> 3; pieces {0, 1}, {2}, {3}.
  auto priced = plan::price_pieces({{0, 1}, {2}, {3}}, {1, 2, 3, 4}, {{}, {0}, {0}, {1, 2}});
  EXPECT_EQ(priced.seconds, (std::vector<double>{3, 3, 4}));
  EXPECT_EQ(priced.preds[0], std::vector<int>{});
  EXPECT_EQ(priced.preds[1], std::vector<int>{0});
  EXPECT_EQ(priced.preds[2], (std::vector<int>{0, 1}));
  EXPECT_EQ(priced.piece_of, (std::vector<int>{0, 0, 1, 2}));
}

TEST(Pieces, ALanesGroupsJoinUntilOneReadsAnotherLane) {
  // Groups 0, 1 on lane 0 (a chain), 2 on lane 1, then 3 on lane 0
  // reading 1 and 2: 0 and 1 join; 3 reads lane 1's part, which the
  // current part does not wait for, so it starts lane 0's next part.
  std::vector<std::vector<int>> deps{{}, {0}, {}, {1, 2}};
  std::vector<int> lane{0, 0, 1, 0};
  auto parts = plan::join_along_lanes(deps, {{0}, {1}, {2}, {3}}, lane);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(parts[1], std::vector<int>{2});
  EXPECT_EQ(parts[2], std::vector<int>{3});
  EXPECT_EQ(lane, (std::vector<int>{0, 1, 0}));
  // A trunk read by another lane's head ends its part there (the head
  // waits for the trunk, not for the head after it on the trunk's lane).
  deps = {{}, {0}, {0}};
  lane = {0, 0, 1};
  parts = plan::join_along_lanes(deps, {{0}, {1}, {2}}, lane);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0], std::vector<int>{0});
  EXPECT_EQ(lane, (std::vector<int>{0, 0, 1}));
}

TEST(Pieces, BranchesSplitAlongTheLanesOnlyWhenWorthTheirCalls) {
  // Two heavy independent branches of 3 nodes and a light join.
  std::vector<std::vector<int>> deps{{}, {0}, {1}, {}, {3}, {4}, {2, 5}};
  std::vector<double> cost{1e-2, 1e-2, 1e-2, 1e-2, 1e-2, 1e-2, 1e-5};
  auto topo = plan::make_topology({"cpu"}, 2, 2);
  plan::CostModel cm;
  cm.partition_call_s = 1e-5;
  std::vector<int> part_lane, part_of;
  auto parts = plan::split_along_lanes(topo, cm, cost, deps, part_lane, part_of);
  ASSERT_GE(parts.size(), 2u);
  ASSERT_EQ(part_lane.size(), parts.size());
  EXPECT_NE(part_lane[part_of[0]], part_lane[part_of[3]]);  // the branches on both lanes
  EXPECT_EQ(part_of[0], part_of[2]);                         // each branch one part
  // Calls dearer than the work: one piece.
  cm.partition_call_s = 1.0;
  EXPECT_TRUE(plan::split_along_lanes(topo, cm, cost, deps, part_lane, part_of).empty());
  EXPECT_TRUE(part_lane.empty());
  // One lane: nothing to split over.
  cm.partition_call_s = 1e-5;
  EXPECT_TRUE(plan::split_along_lanes(plan::make_topology({"cpu"}, 1, 2), cm, cost, deps, part_lane, part_of).empty());
  EXPECT_TRUE(plan::worth_splitting(1.0, 1.2, cm));
  EXPECT_FALSE(plan::worth_splitting(1.0, 1.1, cm));
}

TEST(OpWork, DescribedOpsArePricedByTheRulesOfRecordedOps) {
  std::vector<ir::Output> out{output({64, 32})};
  // Views move nothing.
  auto t = plan::estimate_op_work(schema_of("aten::t"), {tensor_arg({32, 64})}, out);
  EXPECT_EQ(t.flops, 0);
  EXPECT_EQ(t.bytes, 0);
  // sqrt is one vector instruction per element; exp is not.
  auto sq = plan::estimate_op_work(schema_of("aten::sqrt"), {tensor_arg({64, 32})}, out);
  EXPECT_FALSE(sq.transcendental);
  EXPECT_FALSE(sq.gemm);
  EXPECT_EQ(sq.flops, 64 * 32);
  EXPECT_EQ(sq.bytes, 2 * 64 * 32 * 4);
  EXPECT_TRUE(plan::estimate_op_work(schema_of("aten::exp"), {tensor_arg({64, 32})}, out).transcendental);
  // A recorded mm and the same mm described by its schema: the same work.
  torch::manual_seed(0);
  auto a = torch::randn({64, 48}).to(torch_mgpu::device());
  auto b = torch::randn({48, 32}).to(torch_mgpu::device());
  auto c = a.mm(b);
  ir::Graph g = ir::build_graph({capture::buffer_of(c)->value});
  const ir::Node* mm = nullptr;
  for (const auto& n : g.nodes)
    if (n->name == "aten::mm") mm = n.get();
  ASSERT_NE(mm, nullptr);
  auto recorded = plan::estimate_work(*mm);
  auto described = plan::estimate_op_work(schema_of("aten::mm"), mm->args, mm->outputs);
  EXPECT_TRUE(recorded.gemm && described.gemm);
  EXPECT_EQ(recorded.flops, 2.0 * 64 * 48 * 32);
  EXPECT_EQ(described.flops, recorded.flops);
  EXPECT_EQ(described.bytes, recorded.bytes);
  torch_mgpu::synchronize();
}

TEST(Ranks, NodesAWorkerCannotBeSentRunHere) {
  // Two branches planned on a worker's lane and this process's: a node the
  // predicate refuses moves to this process's lane, and the plan is
  // re-simulated there.
  torch::manual_seed(1);
  auto x = torch::randn({64, 64}).to(torch_mgpu::device());
  auto y = torch::randn({64, 64}).to(torch_mgpu::device());
  auto a = torch::tanh(x.mm(x));
  auto b = torch::sigmoid(y.mm(y));
  ir::Graph g = ir::build_graph({capture::buffer_of(a)->value, capture::buffer_of(b)->value});
  auto topo = plan::make_topology({"cpu", "cpu"}, 1, 2);
  topo.lanes[1].rank = 1;
  topo.remote = true;
  plan::CostModel cm;
  plan::Plan p = plan::make_plan(g, topo, cm, "heft");
  for (size_t i = 0; i < g.size(); ++i) p.lane_of[i] = 1;  // everything on the worker
  plan::simulate(g, topo, cm, p);
  const ir::Node* refused = nullptr;
  for (const auto& n : g.nodes)
    if (n->name == "aten::sigmoid") refused = n.get();
  ASSERT_NE(refused, nullptr);
  plan::place_for_ranks(g, topo, cm, {}, p, [&](const ir::Node& n) { return &n != refused; });
  for (size_t i = 0; i < g.size(); ++i) {
    if (g.nodes[i].get() == refused) EXPECT_EQ(p.lane_of[i], 0);
    const auto& order = p.lane_order[p.lane_of[i]];
    EXPECT_NE(std::find(order.begin(), order.end(), static_cast<int>(i)), order.end()) << "node " << i;
  }
  size_t ordered = 0;
  for (const auto& order : p.lane_order) ordered += order.size();
  EXPECT_EQ(ordered, g.size());
  EXPECT_GT(p.predicted_makespan, 0.0);
  torch_mgpu::synchronize();
}

TEST(Groups, ChainsContractAndBranchesStayApart) {
  // Two chains of three (0-1-2, 3-4-5) joined by 6: each chain is a group;
  // the join, small as it is, has two predecessors and no successor: it
  // stays a group of its own, after them.
  const std::vector<double> cost{1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3};
  const std::vector<std::vector<int>> preds{{}, {0}, {1}, {}, {3}, {4}, {2, 5}};
  const auto groups = plan::group_nodes(cost, preds, 1e-6);
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0], (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(groups[1], (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(groups[2], (std::vector<int>{6}));
}

TEST(Groups, SmallSiblingsAreBundledBeforeTheyMoveIntoTheirJoin) {
  // Eight small independent nodes read by one join: with `siblings` (tier
  // 1), bundled in pairs (each pair reaches `small`), not all merged into
  // the join.
  std::vector<double> cost(8, 1e-4);
  cost.push_back(1e-4);
  std::vector<std::vector<int>> preds(8);
  preds.push_back({0, 1, 2, 3, 4, 5, 6, 7});
  const auto groups = plan::group_nodes(cost, preds, 2e-4, /*siblings=*/true);
  ASSERT_EQ(groups.size(), 5u);
  for (size_t k = 0; k < 4; ++k) EXPECT_EQ(groups[k].size(), 2u);
  EXPECT_EQ(groups[4], (std::vector<int>{8}));
  // Every node in one group, each group after the groups it reads.
  std::vector<int> seen;
  for (const auto& g : groups) seen.insert(seen.end(), g.begin(), g.end());
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  // Without: each moves into its only successor, the join (torch.compile's
  // partitioner, which compiles before the first call returns).
  EXPECT_EQ(plan::group_nodes(cost, preds, 2e-4).size(), 1u);
}

TEST(Groups, AReadOfALaterNodeIsRefused) {
  EXPECT_THROW(plan::group_nodes({1e-3, 1e-3}, {{1}, {}}, 1e-6), c10::Error);
}

} // namespace

