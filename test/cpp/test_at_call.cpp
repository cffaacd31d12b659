// Running at the call (engine/at_call.h): the choice per trace, fed times
// (no clock), and the ops of a LibTorch program run at their calls.
#include "backend/backend.h"
#include "engine/at_call.h"
#include "engine/engine.h"
#include "runtime/counters.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include <gtest/gtest.h>

#include <functional>
#include <vector>

using torch_mgpu::engine::at_call::Choices;
using torch_mgpu::engine::at_call::Way;
namespace at_call = torch_mgpu::engine::at_call;

namespace {

// Runs trace `trace` `n` times, each run taking `seconds(way)`; returns the
// ways taken.
std::vector<Way> run(Choices& c, uint64_t trace, size_t n, const std::function<double(Way)>& seconds,
                     bool may_try = true) {
  std::vector<Way> ways;
  for (size_t i = 0; i < n; ++i) {
    Way w = c.begin(may_try);
    ways.push_back(w);
    c.end(trace, 10, seconds(w), may_try);
  }
  return ways;
}

double lazy_slow(Way w) { return w == Way::Lazy ? 3.0 : w == Way::AtCall ? 2.0 : 1.0; }
double lazy_fast(Way w) { return w == Way::Lazy ? 1.0 : 2.0; }

size_t count(const std::vector<Way>& ways, Way w) {
  size_t n = 0;
  for (Way x : ways) n += x == w;
  return n;
}

} // namespace

TEST(AtCallChoices, AHotTraceThatLosesLazilyRunsAtTheCallTheFastestWay) {
  Choices c;
  // Watched: lazy until seen kHotRuns times.
  auto ways = run(c, 7, at_call::kHotRuns, lazy_slow);
  EXPECT_EQ(count(ways, Way::Lazy), ways.size());
  // The trial: kTrialRuns timed runs of each of the three ways, and an untimed one per block.
  ways = run(c, 7, 3 * at_call::kRunsPerWay, lazy_slow);
  EXPECT_EQ(count(ways, Way::Lazy), at_call::kRunsPerWay);
  EXPECT_EQ(count(ways, Way::AtCall), at_call::kRunsPerWay);
  EXPECT_EQ(count(ways, Way::AtCallOneThread), at_call::kRunsPerWay);
  // Chosen: one thread measured fastest.
  ways = run(c, 7, 5, lazy_slow);
  EXPECT_EQ(count(ways, Way::AtCallOneThread), ways.size());
  auto r = c.report();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].way, "at the call, one thread");
  EXPECT_EQ(r[0].state, "chosen");
  EXPECT_EQ(r[0].ops, 10u);
  EXPECT_EQ(r[0].medians_s, (std::vector<double>{3.0, 2.0, 1.0}));
}

TEST(AtCallChoices, TheWaysOfATrialTakeTurnsInBlocksOfRunsInARow) {
  Choices c;
  run(c, 7, at_call::kHotRuns, lazy_slow);
  auto ways = run(c, 7, 3 * at_call::kRunsPerWay, lazy_slow);
  // Blocks of an untimed run and kBlockRuns timed ones; the way called
  // least goes next (ties: the first challenger, the baseline where it ran less).
  const size_t block = at_call::kBlockRuns + 1;
  std::vector<Way> expect;
  for (Way w : {Way::Lazy, Way::AtCall, Way::AtCallOneThread, Way::AtCall, Way::AtCallOneThread, Way::Lazy,
                Way::AtCall, Way::AtCallOneThread, Way::Lazy})
    expect.insert(expect.end(), block, w);
  static_assert(at_call::kTrialRuns == 3 * at_call::kBlockRuns, "three blocks per way");
  EXPECT_EQ(ways, expect);
  EXPECT_EQ(c.report().at(0).state, "chosen");
  // The first run of a block is not timed: a switch that costs the run
  // after it costs no way its place.
  Choices d(false);
  run(d, 7, at_call::kHotRuns, lazy_fast);
  size_t k = 0;
  ways = run(d, 7, 2 * at_call::kRunsPerWay, [&](Way w) { return k++ % block == 0 ? 50.0 : lazy_fast(w); });
  EXPECT_EQ(d.report().at(0).medians_s, (std::vector<double>{1.0, 2.0}));
  EXPECT_EQ(d.report().at(0).way, "lazy");
  // A slower while of the machine over one block of a way does not decide
  // for it: each way's median is of runs from three blocks.
  Choices e(true);
  run(e, 7, at_call::kHotRuns, lazy_slow);
  size_t i = 0;
  run(e, 7, 3 * at_call::kRunsPerWay, [&](Way w) {
    const bool burst = i++ / block == 2;  // the third block: one thread's first
    return (w == Way::AtCallOneThread ? 1.0 : w == Way::AtCall ? 1.5 : 3.0) * (burst ? 4.0 : 1.0);
  });
  EXPECT_EQ(e.report().at(0).way, "at the call, one thread");
}

TEST(AtCallChoices, ATraceThatWinsLazilyStaysLazy) {
  Choices c(/*one_thread_way=*/false);
  run(c, 7, at_call::kHotRuns + 2 * at_call::kRunsPerWay, lazy_fast);
  auto ways = run(c, 7, 10, lazy_fast);
  EXPECT_EQ(count(ways, Way::Lazy), ways.size());
  EXPECT_EQ(c.report().at(0).state, "chosen");
  EXPECT_EQ(c.report().at(0).way, "lazy");
}

TEST(AtCallChoices, WithinTheMarginTheLazyWayIsKept) {
  Choices c(false);
  auto close = [](Way w) { return w == Way::Lazy ? 1.0 : 0.995; };
  run(c, 7, at_call::kHotRuns + 2 * at_call::kRunsPerWay, close);
  EXPECT_EQ(c.report().at(0).way, "lazy");
}

TEST(AtCallChoices, AChoiceIsTriedAgainAfterItsRunsAndTheirCountDoubles) {
  Choices c(false);
  run(c, 7, at_call::kHotRuns + 2 * at_call::kRunsPerWay, lazy_slow);
  // kFirstRetry runs at the call, then a trial again (lazy runs in it).
  auto ways = run(c, 7, at_call::kFirstRetry - 1, lazy_slow);
  EXPECT_EQ(count(ways, Way::AtCall), ways.size());
  ways = run(c, 7, 2 * at_call::kRunsPerWay, lazy_slow);
  EXPECT_EQ(count(ways, Way::Lazy), at_call::kRunsPerWay);
  EXPECT_EQ(c.report().at(0).way, "at the call");
  // The same way won again: twice as many runs before the next trial.
  ways = run(c, 7, 2 * at_call::kFirstRetry - 1, lazy_slow);
  EXPECT_EQ(count(ways, Way::AtCall), ways.size());
  // The machine changed: the next trial goes back to the lazy way.
  run(c, 7, 1 + 2 * at_call::kRunsPerWay, lazy_fast);
  EXPECT_EQ(c.report().at(0).way, "lazy");
}

TEST(AtCallChoices, ATraceIsToldByTheOneThatFollowedItsPredecessor) {
  Choices c(false);
  // A loop of two traces: 1 then 2. Trace 2 loses lazily, trace 1 wins.
  auto two_traces = [&](size_t n) {
    std::vector<Way> first, second;
    for (size_t i = 0; i < n; ++i) {
      first.push_back(c.begin(true));
      c.end(1, 5, lazy_fast(first.back()), true);
      second.push_back(c.begin(true));
      c.end(2, 5, lazy_slow(second.back()), true);
    }
    return std::make_pair(first, second);
  };
  two_traces(at_call::kHotRuns + 2 * at_call::kRunsPerWay);
  auto [first, second] = two_traces(6);
  EXPECT_EQ(count(first, Way::Lazy), first.size());
  EXPECT_EQ(count(second, Way::AtCall), second.size());
  // Another trace after trace 1: predicted 2 (runs at the call), but it is
  // 3; its time is no measure of 2, and 1 is now followed by 3.
  EXPECT_EQ(c.begin(true), Way::Lazy);
  c.end(1, 5, 1.0, true);
  EXPECT_EQ(c.begin(true), Way::AtCall);
  c.end(3, 5, 100.0, true);
  for (const auto& r : c.report())
    if (r.trace == 2) EXPECT_EQ(r.medians_s, (std::vector<double>{3.0, 2.0}));
  EXPECT_EQ(c.begin(true), Way::Lazy);  // after 3: never seen followed
  c.end(1, 5, 1.0, true);
  EXPECT_EQ(c.begin(true), Way::Lazy);  // after 1 came 3 last time: watched
}

TEST(AtCallChoices, AChosenWayThatRunsSlowerThanItsTrialMeasuredGivesWayToTheFasterOne) {
  Choices c;
  // The trial: lazy 1.0, at the call 2.0, one thread 3.0. Lazy is chosen.
  auto trial = [](Way w) { return w == Way::Lazy ? 1.0 : w == Way::AtCall ? 2.0 : 3.0; };
  run(c, 7, at_call::kHotRuns + 3 * at_call::kRunsPerWay, trial);
  ASSERT_EQ(c.report().at(0).way, "lazy");
  // On its own the lazy way runs at 1.2 (within kDrift): it stays.
  auto ways = run(c, 7, 2 * at_call::kSteadyRuns, [](Way w) { return w == Way::Lazy ? 1.2 : 9.0; });
  EXPECT_EQ(count(ways, Way::Lazy), ways.size());
  EXPECT_EQ(c.report().at(0).medians_s, (std::vector<double>{1.0, 2.0, 3.0}));
  // Then at 2.5: after a group of kSteadyRuns, the way at the call (2.0)
  // runs instead, and 2.5 is the lazy way's measure.
  ways = run(c, 7, at_call::kSteadyRuns, [](Way w) { return w == Way::Lazy ? 2.5 : 9.0; });
  EXPECT_EQ(count(ways, Way::Lazy), ways.size());
  auto r = c.report().at(0);
  EXPECT_EQ(r.way, "at the call");
  EXPECT_EQ(r.state, "chosen");
  EXPECT_EQ(r.medians_s, (std::vector<double>{2.5, 2.0, 3.0}));
  EXPECT_NE(r.why.find("lazy then ran 2500000 us"), std::string::npos) << r.why;
  // The way at the call drifts to 4.0: the lazy way's 2.5 is the fastest
  // measure again. Then the lazy way runs at 3.5: one thread (3.0).
  ways = run(c, 7, at_call::kSteadyRuns, [](Way w) { return w == Way::AtCall ? 4.0 : 9.0; });
  EXPECT_EQ(count(ways, Way::AtCall), ways.size());
  EXPECT_EQ(c.report().at(0).way, "lazy");
  ways = run(c, 7, at_call::kSteadyRuns, [](Way w) { return w == Way::Lazy ? 3.5 : 9.0; });
  EXPECT_EQ(count(ways, Way::Lazy), ways.size());
  EXPECT_EQ(c.report().at(0).way, "at the call, one thread");
  EXPECT_EQ(c.report().at(0).medians_s, (std::vector<double>{3.5, 4.0, 3.0}));
  ways = run(c, 7, 3, [](Way) { return 3.0; });
  EXPECT_EQ(count(ways, Way::AtCallOneThread), ways.size());
}

TEST(AtCallChoices, ADriftWithNoFasterWayKeepsTheChoice) {
  Choices c(false);
  run(c, 7, at_call::kHotRuns + 2 * at_call::kRunsPerWay, lazy_slow);  // at the call 2.0, lazy 3.0
  ASSERT_EQ(c.report().at(0).way, "at the call");
  // At the call runs at 2.9: slower than measured, but still faster than
  // the lazy way's 3.0 by the trial's margin.
  auto ways = run(c, 7, at_call::kSteadyRuns, [](Way w) { return w == Way::AtCall ? 2.9 : 9.0; });
  EXPECT_EQ(count(ways, Way::AtCall), ways.size());
  EXPECT_EQ(c.report().at(0).way, "at the call");
  EXPECT_EQ(c.report().at(0).medians_s, (std::vector<double>{3.0, 2.9}));
  // At 3.2 the lazy way takes over.
  run(c, 7, at_call::kSteadyRuns, [](Way w) { return w == Way::AtCall ? 3.2 : 9.0; });
  EXPECT_EQ(c.report().at(0).way, "lazy");
}

TEST(AtCallChoices, NoTrialStartsWhileTrialsMayNotRun) {
  Choices c;
  auto ways = run(c, 7, 40, lazy_slow, /*may_try=*/false);
  EXPECT_EQ(count(ways, Way::Lazy), ways.size());
  EXPECT_EQ(c.report().at(0).state, "watched");
}

TEST(AtCallChoices, TheLazyWayIsTimedOnceTierOneSettledItsGraphs) {
  // Tier 1 decides about the lazy way's graph for 12 runs (compile, then
  // its trial in turns with tier 0: 3.0 a run), then keeps compiled code
  // (1.0 a run). The way at the call runs at 2.0.
  Choices c(false);
  size_t lazy_runs = 0;
  auto step = [&] {
    const Way w = c.begin(true);
    const bool settled = w != Way::Lazy || lazy_runs >= 12;
    const double s = w == Way::Lazy ? (settled ? 1.0 : 3.0) : 2.0;
    if (w == Way::Lazy) ++lazy_runs;
    c.end(7, 10, s, true, settled);
    return w;
  };
  std::vector<Way> ways;
  for (size_t i = 0; i < at_call::kHotRuns + 12 + 2 * at_call::kRunsPerWay; ++i) ways.push_back(step());
  auto r = c.report().at(0);
  EXPECT_EQ(r.way, "lazy") << r.why;
  EXPECT_EQ(r.medians_s, (std::vector<double>{1.0, 2.0}));
  // The trial's lazy runs waited for tier 1 (untimed), then ran in a row.
  EXPECT_EQ(count(ways, Way::AtCall), at_call::kRunsPerWay);
  // A graph tier 1 never settles: the lazy way is timed after
  // kMaxUnsettledRuns runs of the trial all the same.
  Choices d(false);
  run(d, 8, at_call::kHotRuns, lazy_slow);
  for (size_t i = 0; i < at_call::kMaxUnsettledRuns + 2 * at_call::kRunsPerWay; ++i) {
    const Way w = d.begin(true);
    d.end(8, 10, lazy_slow(w), true, /*settled=*/w != Way::Lazy);
  }
  EXPECT_EQ(d.report().at(0).state, "chosen");
  EXPECT_EQ(d.report().at(0).way, "at the call");
}

// LibTorch with no Python: with at_call "on", ops run at their calls (no
// pending op after each), with eager's values, in-place writes and views.
TEST(AtCall, OpsOfALibTorchProgramRunAtTheirCalls) {
  torch_mgpu::init();
  at_call::set_mode("on");
  auto ops_before = torch_mgpu::runtime::counters().at_call_ops.load();
  auto g = at::make_generator<at::CPUGeneratorImpl>(3);
  auto a = at::randn({8, 8}, g), b = at::randn({8, 8}, g);
  auto ma = a.to("mgpu"), mb = b.to("mgpu");
  EXPECT_EQ(torch_mgpu::pending_ops(), 0);  // an upload is a snapshot, at the call too
  auto c = at::mm(ma, mb).relu();
  EXPECT_EQ(torch_mgpu::pending_ops(), 0);
  auto v = c.select(0, 2);
  v.mul_(2.0);  // through a view: c changes too
  EXPECT_EQ(torch_mgpu::pending_ops(), 0);
  auto ref = at::mm(a, b).relu();
  ref.select(0, 2).mul_(2.0);
  EXPECT_TRUE(at::equal(c.cpu(), ref));
  EXPECT_GE(torch_mgpu::runtime::counters().at_call_ops.load() - ops_before, 3);
  // An error at the call, eager's, and the tensors stay usable.
  EXPECT_THROW(at::mm(ma, mb.narrow(0, 0, 3)), c10::Error);
  EXPECT_TRUE(at::equal(ma.cpu(), a));
  at_call::set_mode("auto");
}

// A write at the call goes into the value's own bytes where nothing else
// holds them (as eager writes), and into a copy where a host tensor shares
// them (its bytes stay as they were).
TEST(AtCall, AWriteGoesIntoItsOwnBytesUnlessSomethingElseHoldsThem) {
  torch_mgpu::init();
  at_call::set_mode("on");
  auto x = at::arange(16, at::kFloat);
  auto m = x.to("mgpu");
  const void* before = torch_mgpu::engine::materialize(m.storage()).data();
  m.add_(1.0);
  EXPECT_EQ(torch_mgpu::engine::materialize(m.storage()).data(), before);
  EXPECT_TRUE(at::equal(m.cpu(), x + 1));
  auto host = torch_mgpu::backend::value_view(m, c10::Device(c10::kCPU));  // shares the bytes
  EXPECT_EQ(host.data_ptr(), before);
  m.mul_(2.0);
  EXPECT_NE(torch_mgpu::engine::materialize(m.storage()).data(), before);
  EXPECT_TRUE(at::equal(host, x + 1));
  EXPECT_TRUE(at::equal(m.cpu(), (x + 1) * 2));
  at_call::set_mode("auto");
}
