// The stream-lane path of the executor, run on CPU: a test guard
// implementation gives the CPU device streams and events that log what the
// executor asks of them. The kernels themselves run on the host (they finish
// when called), so results must equal eager's; the log must show the device
// ordering a real stream backend (CUDA) would need.
#include "capture/lazy_tensor.h"
#include "engine/replays.h"
#include "ir/graph.h"
#include "plan/plan.h"
#include "runtime/counters.h"
#include "runtime/executor.h"
#include "runtime/faults.h"
#include "runtime/replay.h"
#include "runtime/sanitizer.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace {

using namespace torch_mgpu;

struct Entry {
  std::string what;  // "record", "block", "sync", "use"
  intptr_t event = 0;
  c10::StreamId stream = 0;
};

// CPU with streams: a per-thread current stream, events that are counters.
struct FakeStreams final : c10::impl::DeviceGuardImplInterface {
  mutable std::mutex m;
  mutable std::vector<Entry> log;
  mutable intptr_t next_event = 0;
  static thread_local c10::StreamId current;

  void add(Entry e) const {
    std::lock_guard<std::mutex> lock(m);
    log.push_back(std::move(e));
  }
  c10::DeviceType type() const override { return c10::DeviceType::CPU; }
  c10::Device exchangeDevice(c10::Device) const override { return c10::Device(c10::kCPU); }
  c10::Device getDevice() const override { return c10::Device(c10::kCPU); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCPU), current);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    current = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  // Timing events (enable_timing) order nothing: logged apart, as "timing",
  // with the host time of their record (the fake's kernels are done when
  // they return).
  mutable std::map<intptr_t, double> recorded_at;
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex, const c10::EventFlag flag) const override {
    {
      std::lock_guard<std::mutex> lock(m);
      if (!*event) *event = reinterpret_cast<void*>(++next_event);
      recorded_at[reinterpret_cast<intptr_t>(*event)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    add({flag == c10::EventFlag::BACKEND_DEFAULT ? "timing" : "record", reinterpret_cast<intptr_t>(*event), stream.id()});
  }
  double elapsedTime(void* a, void* b, const c10::DeviceIndex) const override {
    std::lock_guard<std::mutex> lock(m);
    return (recorded_at.at(reinterpret_cast<intptr_t>(b)) - recorded_at.at(reinterpret_cast<intptr_t>(a))) * 1000.0;
  }
  void block(void* event, const c10::Stream& stream) const override {
    add({"block", reinterpret_cast<intptr_t>(event), stream.id()});
  }
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream& stream) const override { add({"sync", 0, stream.id()}); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream& stream) const override {
    add({"use", 0, stream.id()});
  }
};
thread_local c10::StreamId FakeStreams::current = 0;

// Installs the fake for CPU for one test, then puts the real one back.
struct WithFakeStreams {
  FakeStreams* fake = new FakeStreams();  // the registry does not own (and may outlive) it
  const c10::impl::DeviceGuardImplInterface* saved;
  WithFakeStreams() {
    saved = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CPU)].exchange(fake);
  }
  ~WithFakeStreams() { c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CPU)].store(saved); }
};

std::vector<runtime::Place> stream_places(int lanes) {
  std::vector<runtime::Place> out;
  for (int l = 0; l < lanes; ++l) {
    runtime::Place p;
    p.stream = c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCPU), 100 + l);
    p.kind = runtime::LaneKind::Stream;
    out.push_back(p);
  }
  return out;
}

// Nodes in topological order dealt round-robin to `lanes` lanes: every edge
// between neighbours in that order crosses lanes.
plan::Plan round_robin(const ir::Graph& g, const plan::Topology& t, int lanes) {
  plan::Plan p = plan::make_serial_plan(g, t, plan::CostModel());
  std::vector<int> order = p.lane_order[0];
  p.lane_order.assign(t.lanes.size(), {});
  for (size_t k = 0; k < order.size(); ++k) {
    int lane = static_cast<int>(k % lanes);
    p.lane_of[order[k]] = lane;
    p.lane_order[lane].push_back(order[k]);
  }
  p.lanes_used = lanes;
  p.threads_per_lane = at::get_num_threads();  // eager's: results equal bitwise
  plan::compute_reuse(g, p);
  return p;
}

struct Captured {
  std::vector<at::Tensor> outputs;  // mgpu
  std::vector<at::Tensor> expected;  // eager
  ir::Graph graph;
};

Captured branches() {
  torch::manual_seed(1);
  Captured c;
  std::vector<ir::Value> roots;
  for (int b = 0; b < 4; ++b) {
    auto x = torch::randn({24, 24});
    auto xm = x.to(torch_mgpu::device());
    auto ym = torch::tanh(torch::mm(xm, xm)).mul(0.5).add_(1.0);
    c.expected.push_back(torch::tanh(torch::mm(x, x)).mul(0.5).add_(1.0));
    c.outputs.push_back(ym);
    roots.push_back(capture::buffer_of(ym)->value);
  }
  c.graph = ir::build_graph(roots);
  return c;
}

at::Tensor result(const runtime::ExecResult& r, const Captured& c, size_t k) {
  const ir::Value& v = c.graph.roots[k];
  for (size_t i = 0; i < c.graph.size(); ++i)
    if (c.graph.nodes[i] == v.node) return runtime::cpu_view(r.values[i][v.index], capture::geometry_of(c.outputs[k]));
  return at::Tensor();
}

TEST(StreamLanes, CrossLaneEdgesCarryEvents) {
  Captured c = branches();
  auto topo = plan::make_topology({"cpu"}, 3, at::get_num_threads());
  plan::Plan p = round_robin(c.graph, topo, 3);
  auto places = stream_places(3);
  WithFakeStreams fake;
  runtime::ExecResult r = runtime::execute(c.graph, p, places);
  ASSERT_FALSE(r.first_error);
  for (size_t k = 0; k < c.outputs.size(); ++k)
    EXPECT_TRUE(torch::equal(result(r, c, k), c.expected[k])) << (result(r, c, k) - c.expected[k]).abs().max();

  // Every edge across lanes: the producer's event recorded on its stream,
  // then waited for on the reader's stream.
  std::map<intptr_t, c10::StreamId> recorded_on;
  std::set<std::pair<intptr_t, c10::StreamId>> blocks;
  std::set<c10::StreamId> synced, used;
  for (const auto& e : fake.fake->log) {
    if (e.what == "record") recorded_on[e.event] = e.stream;
    if (e.what == "block") {
      ASSERT_TRUE(recorded_on.count(e.event)) << "waited for an event before it was recorded";
      EXPECT_NE(recorded_on[e.event], e.stream);
      blocks.insert({e.event, e.stream});
    }
    if (e.what == "sync") synced.insert(e.stream);
    if (e.what == "use") used.insert(e.stream);
  }
  int cross = 0;
  for (size_t i = 0; i < c.graph.size(); ++i)
    for (int d : c.graph.deps[i])
      if (p.lane_of[d] != p.lane_of[i]) {
        ++cross;
        bool found = false;
        for (const auto& [ev, stream] : blocks)
          found |= stream == 100 + p.lane_of[i] && recorded_on[ev] == 100 + p.lane_of[d];
        EXPECT_TRUE(found) << "edge " << d << " -> " << i << " has no event";
      }
  EXPECT_GT(cross, 0);
  EXPECT_EQ(synced, (std::set<c10::StreamId>{100, 101, 102}));  // each lane waits for its stream
  EXPECT_EQ(used, (std::set<c10::StreamId>{100, 101, 102}));     // operands recorded on their readers' streams
  EXPECT_EQ(FakeStreams::current, 0);  // the calling thread's stream is restored
}

TEST(StreamLanes, NodeTimesComeFromTheDevicesEvents) {
  Captured c = branches();
  auto topo = plan::make_topology({"cpu"}, 2, at::get_num_threads());
  plan::Plan p = round_robin(c.graph, topo, 2);
  WithFakeStreams fake;
  runtime::ExecResult r = runtime::execute(c.graph, p, stream_places(2));
  ASSERT_FALSE(r.first_error);
  // One timing event per node, plus one per lane where its clock starts.
  int timing = 0;
  for (const auto& e : fake.fake->log) timing += e.what == "timing";
  EXPECT_EQ(timing, static_cast<int>(c.graph.size()) + 2);
  for (int l = 0; l < 2; ++l) {
    double previous = 0;
    for (int i : p.lane_order[l]) {
      const auto& t = r.timing[i];
      EXPECT_LE(previous, t.start) << "node " << i;  // a stream runs its nodes in order
      EXPECT_LE(t.start, t.end);
      EXPECT_LE(t.end, r.makespan + 1e-3);
      previous = t.end;
    }
  }
}

TEST(StreamLanes, OneLaneNeedsNoEvents) {
  Captured c = branches();
  auto topo = plan::make_topology({"cpu"}, 2, at::get_num_threads());
  plan::Plan p = plan::make_serial_plan(c.graph, topo, plan::CostModel());
  WithFakeStreams fake;
  runtime::ExecResult r = runtime::execute(c.graph, p, stream_places(2));
  ASSERT_FALSE(r.first_error);
  for (size_t k = 0; k < c.outputs.size(); ++k) EXPECT_TRUE(torch::equal(result(r, c, k), c.expected[k]));
  int records = 0, syncs = 0;
  for (const auto& e : fake.fake->log) {
    records += e.what == "record" || e.what == "block";
    syncs += e.what == "sync";
  }
  EXPECT_EQ(records, 0);
  EXPECT_EQ(syncs, 1);
}

TEST(StreamLanes, LanesShareOneCopyPerDeviceAndWaitForIt) {
  // a = x @ x on device 0; b = tanh(a) and c = sigmoid(a) on the two lanes of
  // device 1: one copy of a reaches device 1, made by one of them, and the
  // other lane's stream waits for it.
  torch::manual_seed(2);
  auto x = torch::randn({16, 16});
  auto xm = x.to(torch_mgpu::device());
  auto am = torch::mm(xm, xm);
  auto bm = torch::tanh(am);
  auto cm = torch::sigmoid(am);
  ir::Graph g = ir::build_graph({capture::buffer_of(bm)->value, capture::buffer_of(cm)->value});
  ASSERT_EQ(g.size(), 3u);
  auto topo = plan::make_topology({"cpu", "cpu"}, 2, at::get_num_threads());
  plan::Plan p = plan::make_serial_plan(g, topo, plan::CostModel());
  p.lane_order.assign(topo.lanes.size(), {});
  const int lanes_for[3] = {0, 2, 3};  // mm on cpu:0/lane0; tanh, sigmoid on cpu:1's lanes
  for (int i = 0; i < 3; ++i) {
    p.lane_of[i] = lanes_for[i];
    p.lane_order[lanes_for[i]].push_back(i);
  }
  p.lanes_used = 3;
  p.threads_per_lane = at::get_num_threads();
  plan::compute_reuse(g, p);
  const auto before = torch_mgpu::stats().at("bytes_transferred");
  WithFakeStreams fake;
  runtime::ExecResult r = runtime::execute(g, p, stream_places(4));
  ASSERT_FALSE(r.first_error);
  auto a = torch::mm(x, x);
  auto out = [&](int i) { return runtime::cpu_view(r.values[i][0], capture::geometry_of(i == 1 ? bm : cm)); };
  EXPECT_TRUE(torch::equal(out(1), torch::tanh(a)));
  EXPECT_TRUE(torch::equal(out(2), torch::sigmoid(a)));
  EXPECT_EQ(torch_mgpu::stats().at("bytes_transferred") - before, static_cast<int64_t>(a.nbytes()));  // one copy
  std::map<intptr_t, c10::StreamId> recorded_on;
  bool copy_waited = false;
  for (const auto& e : fake.fake->log) {
    if (e.what == "record") recorded_on[e.event] = e.stream;
    if (e.what == "block" && recorded_on.count(e.event)) {
      c10::StreamId from = recorded_on[e.event];
      copy_waited |= (from == 102 && e.stream == 103) || (from == 103 && e.stream == 102);
    }
  }
  EXPECT_TRUE(copy_waited) << "the second lane of device 1 did not wait for the copy";
}

TEST(StreamLanes, VirtualDevicesCopyValuesThatCross) {
  Captured c = branches();
  auto topo = plan::make_topology({"cpu", "cpu"}, 1, at::get_num_threads());
  plan::Plan p = round_robin(c.graph, topo, 2);
  auto before = torch_mgpu::stats().at("bytes_transferred");
  runtime::ExecResult r = runtime::execute(c.graph, p, runtime::make_places(topo));
  ASSERT_FALSE(r.first_error);
  for (size_t k = 0; k < c.outputs.size(); ++k) EXPECT_TRUE(torch::equal(result(r, c, k), c.expected[k]));
  EXPECT_GT(torch_mgpu::stats().at("bytes_transferred"), before);
}

// The stream-order sanitizer over the executor: a round-robin plan (every
// edge between neighbours crosses streams) has no race; leaving out one
// cross-lane wait does, and the report names both nodes.
struct Sanitized {
  Sanitized() { runtime::start_stream_sanitizer(); }
  ~Sanitized() { runtime::stop_stream_sanitizer(); }
};

TEST(StreamSanitizer, RoundRobinPlansHaveNoRace) {
  Captured c = branches();
  for (int lanes : {2, 3}) {
    auto topo = plan::make_topology({"cpu"}, lanes, at::get_num_threads());
    plan::Plan p = round_robin(c.graph, topo, lanes);
    Sanitized on;
    runtime::ExecResult r = runtime::execute(c.graph, p, stream_places(lanes));
    ASSERT_FALSE(r.first_error);
    EXPECT_GE(runtime::stream_sanitizer_accesses(), static_cast<int64_t>(c.graph.size()));
    auto races = runtime::take_stream_sanitizer_races();
    EXPECT_TRUE(races.empty()) << races.front();
  }
}

TEST(StreamSanitizer, ADroppedWaitIsARaceNamingBothNodes) {
  Captured c = branches();
  auto topo = plan::make_topology({"cpu"}, 3, at::get_num_threads());
  plan::Plan p = round_robin(c.graph, topo, 3);
  Sanitized on;
  runtime::inject_fault("drop_event_wait", 1);
  runtime::ExecResult r = runtime::execute(c.graph, p, stream_places(3));
  runtime::inject_fault("drop_event_wait", 0);
  ASSERT_FALSE(r.first_error);
  auto races = runtime::take_stream_sanitizer_races();
  ASSERT_FALSE(races.empty());
  // A cross-lane edge whose reader did not wait (which one depends on the
  // lanes' timing; every one in a round-robin plan is a race).
  EXPECT_NE(races[0].find("write by node"), std::string::npos) << races[0];
  EXPECT_NE(races[0].find("read by node"), std::string::npos) << races[0];
}

TEST(StreamSanitizer, AStreamLeftRunningIsARaceWithTheHostsRead) {
  // Work on a stream nobody synchronizes, then read by the host.
  Sanitized on;
  auto x = torch::randn({8});
  {
    c10::StreamGuard guard(c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCPU), 7));
    runtime::report_stream_access(c10::Device(c10::kCPU), "a kernel", {}, {x.data_ptr()});
  }
  runtime::report_host_read(x.data_ptr(), "the test");
  auto races = runtime::take_stream_sanitizer_races();
  ASSERT_EQ(races.size(), 1u);
  EXPECT_NE(races[0].find("read by the host"), std::string::npos) << races[0];
  // Once the host synchronizes that stream, the read is ordered.
  c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCPU), 7).synchronize();
  runtime::report_host_read(x.data_ptr(), "the test");
  EXPECT_TRUE(runtime::take_stream_sanitizer_races().empty());
}

// A failure on a stream lane (a wait for another lane's event, a transfer,
// the kernel, the stream's final synchronize) becomes a node's error or the
// run's: the process lives, the failing node fails alone, and every node
// that does not depend on it computes eager's result.
void expect_contained_failure(const std::string& point, bool node_level, bool two_devices) {
  SCOPED_TRACE(point);
  Captured c = branches();
  auto topo = plan::make_topology(two_devices ? std::vector<std::string>{"cpu", "cpu"} : std::vector<std::string>{"cpu"},
                                  two_devices ? 1 : 3, at::get_num_threads());
  const int lanes = two_devices ? 2 : 3;
  plan::Plan p = round_robin(c.graph, topo, lanes);
  WithFakeStreams fake;
  const int64_t fired = runtime::faults_fired(point);
  runtime::inject_fault(point, 1);
  runtime::ExecResult r = runtime::execute(c.graph, p, stream_places(lanes));
  runtime::inject_fault(point, 0);
  ASSERT_EQ(runtime::faults_fired(point), fired + 1) << "the fault point was not reached";
  ASSERT_TRUE(r.first_error);
  EXPECT_NE(r.first_message.find("injected fault (" + point), std::string::npos) << r.first_message;
  int failed = 0, skipped = 0;
  std::vector<bool> lost(c.graph.size(), false);
  for (size_t i = 0; i < c.graph.size(); ++i) {
    failed += r.status[i] == runtime::Status::Failed;
    skipped += r.status[i] == runtime::Status::Skipped;
    for (int d : c.graph.deps[i]) lost[i] = lost[i] || lost[d] || r.status[d] != runtime::Status::Ok;
    if (lost[i]) EXPECT_NE(r.status[i], runtime::Status::Ok) << "node " << i << " ran on a failed input";
    else if (r.status[i] == runtime::Status::Failed) lost[i] = true;
  }
  EXPECT_EQ(failed, node_level ? 1 : 0);
  if (!node_level) EXPECT_EQ(skipped, 0);
  for (size_t k = 0; k < c.outputs.size(); ++k) {
    const int i = c.graph.find(c.graph.roots[k].node.get());
    if (r.status[i] == runtime::Status::Ok)
      EXPECT_TRUE(torch::equal(result(r, c, k), c.expected[k])) << "branch " << k;
  }
}

TEST(StreamLanes, AFailedEventWaitFailsItsNode) { expect_contained_failure("event_wait", true, false); }
TEST(StreamLanes, AFailedKernelFailsItsNode) { expect_contained_failure("node", true, false); }
TEST(StreamLanes, AFailedTransferFailsItsNode) { expect_contained_failure("transfer", true, true); }
TEST(StreamLanes, AFailedStreamSynchronizeIsTheRunsError) { expect_contained_failure("stream_sync", false, false); }

// Parts (runtime::Part: nodes run as one call, as compiled parts are):
// x -> mm -> tanh is one part on lane 0, x -> sigmoid -> mul another on
// lane 1, and their sum a plain node on lane 0 after them.
struct PartsCase {
  at::Tensor x, tanh_m, mul_m, sum_m;
  ir::Graph g;
  plan::Plan p;
  runtime::Parts parts;
  std::atomic<int> calls{0};  // the parts run on two lanes at once
  bool fail_second = false;

  PartsCase() {
    torch::manual_seed(6);
    x = torch::randn({32, 32});
    auto xm = x.to(torch_mgpu::device());
    auto mm = torch::mm(xm, xm);
    tanh_m = torch::tanh(mm);
    auto sig = torch::sigmoid(xm);
    mul_m = sig * 2.5;
    sum_m = tanh_m + mul_m;
    g = ir::build_graph({capture::buffer_of(sum_m)->value});
    EXPECT_EQ(g.size(), 5u);
    auto at = [&](const at::Tensor& t) { return g.find(capture::buffer_of(t)->value.node.get()); };
    auto topo = plan::make_topology({"cpu"}, 2, at::get_num_threads());
    p = plan::make_serial_plan(g, topo, plan::CostModel());
    p.lane_order = {{at(mm), at(tanh_m), at(sum_m)}, {at(sig), at(mul_m)}};
    p.lane_of.assign(g.size(), 0);
    p.lane_of[at(sig)] = p.lane_of[at(mul_m)] = 1;
    p.lanes_used = 2;
    p.threads_per_lane = at::get_num_threads();
    plan::compute_reuse(g, p);
    parts.part_at.assign(g.size(), -1);
    parts.part_of.assign(g.size(), -1);
    const ir::Value xv = capture::buffer_of(xm)->value;
    const auto xgeom = capture::geometry_of(xm);
    add({at(mm), at(tanh_m)}, xv, xgeom, at(tanh_m), [](const at::Tensor& in) { return torch::tanh(torch::mm(in, in)); });
    add({at(sig), at(mul_m)}, xv, xgeom, at(mul_m), [this](const at::Tensor& in) {
      if (fail_second) throw std::runtime_error("the second part failed");
      return torch::sigmoid(in) * 2.5;
    });
  }

  void add(std::vector<int> nodes, const ir::Value& read, const ir::TensorGeometry& geom, int makes,
           std::function<at::Tensor(const at::Tensor&)> f) {
    runtime::Part part;
    part.nodes = nodes;
    part.reads = {{read, -1}};
    part.makes = {{makes, 0}};
    part.name = "part " + std::to_string(parts.parts.size());
    part.call = [this, f, geom](const std::vector<c10::Storage>& reads, const runtime::Place&,
                                std::vector<const void*>& written) {
      ++calls;
      at::Tensor out = f(runtime::cpu_view(reads.at(0), geom)).contiguous();
      written.push_back(out.storage().data());
      return std::vector<c10::Storage>{out.storage()};
    };
    const int k = static_cast<int>(parts.parts.size());
    for (int i : nodes) parts.part_of[i] = k;
    parts.part_at[nodes.at(0)] = k;
    parts.parts.push_back(std::move(part));
  }

  at::Tensor value(const runtime::ExecResult& r, const at::Tensor& t) {
    const int i = g.find(capture::buffer_of(t)->value.node.get());
    return runtime::cpu_view(r.values[i][0], capture::geometry_of(t));
  }
};

TEST(Parts, RunAsOneCallEachInStreamOrder) {
  PartsCase pc;
  WithFakeStreams fake;
  runtime::ExecResult r = runtime::execute(pc.g, pc.p, stream_places(2), &pc.parts);
  ASSERT_FALSE(r.first_error);
  EXPECT_EQ(pc.calls, 2);
  auto want = torch::tanh(torch::mm(pc.x, pc.x)) + torch::sigmoid(pc.x) * 2.5;
  EXPECT_TRUE(torch::allclose(pc.value(r, pc.sum_m), want));
  for (size_t i = 0; i < pc.g.size(); ++i) EXPECT_EQ(r.status[i], runtime::Status::Ok);
  // The sum (lane 0) waits on its stream for the event lane 1's stream
  // recorded after the second part; the part's input is recorded on its
  // stream.
  std::map<intptr_t, c10::StreamId> recorded_on;
  bool waited = false;
  std::set<c10::StreamId> used;
  for (const auto& e : fake.fake->log) {
    if (e.what == "record") recorded_on[e.event] = e.stream;
    if (e.what == "block") waited |= recorded_on.count(e.event) && recorded_on[e.event] == 101 && e.stream == 100;
    if (e.what == "use") used.insert(e.stream);
  }
  EXPECT_TRUE(waited);
  EXPECT_EQ(used, (std::set<c10::StreamId>{100, 101}));
}

TEST(Parts, AFailedPartFailsItsNodesAndSkipsItsReaders) {
  PartsCase pc;
  pc.fail_second = true;
  runtime::ExecResult r = runtime::execute(pc.g, pc.p, {runtime::Place(), runtime::Place()}, &pc.parts);
  ASSERT_TRUE(r.first_error);
  EXPECT_NE(r.first_message.find("the second part failed"), std::string::npos) << r.first_message;
  auto status = [&](const at::Tensor& t) { return r.status[pc.g.find(capture::buffer_of(t)->value.node.get())]; };
  EXPECT_EQ(status(pc.tanh_m), runtime::Status::Ok);
  EXPECT_EQ(status(pc.mul_m), runtime::Status::Failed);
  EXPECT_EQ(status(pc.sum_m), runtime::Status::Skipped);
  EXPECT_TRUE(torch::allclose(pc.value(r, pc.tanh_m), torch::tanh(torch::mm(pc.x, pc.x))));
}

TEST(StreamSanitizer, ADroppedWaitAfterAPartIsARaceNamingIt) {
  PartsCase pc;
  {
    Sanitized on;
    runtime::ExecResult r = runtime::execute(pc.g, pc.p, stream_places(2), &pc.parts);
    ASSERT_FALSE(r.first_error);
    EXPECT_TRUE(runtime::take_stream_sanitizer_races().empty());
  }
  Sanitized on;
  runtime::inject_fault("drop_event_wait", 1);
  runtime::ExecResult r = runtime::execute(pc.g, pc.p, stream_places(2), &pc.parts);
  runtime::inject_fault("drop_event_wait", 0);
  ASSERT_FALSE(r.first_error);
  auto races = runtime::take_stream_sanitizer_races();
  ASSERT_FALSE(races.empty());
  EXPECT_NE(races[0].find("write by part 1"), std::string::npos) << races[0];
}

// Three branches over inputs of their own, joined by a sum: a graph whose
// run on round-robin stream lanes waits across lanes, with in-place steps.
struct Replayable {
  std::vector<at::Tensor> xs, xms;
  at::Tensor total;
  ir::Graph g;

  Replayable() {
    torch::manual_seed(3);
    at::Tensor sum;
    for (int b = 0; b < 3; ++b) {
      xs.push_back(torch::randn({16, 16}));
      xms.push_back(xs.back().to(torch_mgpu::device()));
      auto y = torch::tanh(torch::mm(xms.back(), xms.back())).mul(0.5).add_(1.0);
      sum = b ? sum + y : y;
    }
    total = sum;
    g = ir::build_graph({capture::buffer_of(total)->value});
  }
  static at::Tensor eager(const std::vector<at::Tensor>& in) {
    at::Tensor sum;
    for (size_t b = 0; b < in.size(); ++b) {
      auto y = torch::tanh(torch::mm(in[b], in[b])).mul(0.5).add_(1.0);
      sum = b ? sum + y : y;
    }
    return sum;
  }
  // New values in the recording's inputs (its static inputs), as a caller
  // copies them in before a replay; returns them.
  std::vector<at::Tensor> set_inputs(const runtime::Recording& rec) {
    std::vector<at::Tensor> fresh;
    for (size_t b = 0; b < xms.size(); ++b) fresh.push_back(torch::randn({16, 16}));
    for (const auto& [v, bytes] : rec.inputs)
      for (size_t b = 0; b < xms.size(); ++b)
        if (capture::buffer_of(xms[b])->value.node == v.node)
          runtime::cpu_view(bytes, capture::geometry_of(xms[b])).copy_(fresh[b]);
    return fresh;
  }
  at::Tensor result(const runtime::Recording& rec) const {
    for (const auto& [v, bytes] : rec.outputs)
      if (v.node == capture::buffer_of(total)->value.node) return runtime::cpu_view(bytes, capture::geometry_of(total));
    return at::Tensor();
  }
};

size_t steps_of(const runtime::Recording& rec, runtime::Recording::Step::Kind kind) {
  size_t n = 0;
  for (const auto& lane : rec.lanes)
    for (const auto& s : lane) n += s.kind == kind;
  return n;
}

// A Replayable's run on `lanes` CPU stream lanes (round-robin), recorded
// under the sanitizer, which stays on while this lives.
struct RecordedRun {
  struct Quiet {
    Quiet() { torch_mgpu::synchronize(); }  // no flight of earlier tests' work runs beside the sanitizer
  } quiet;
  Replayable c;
  Sanitized on;
  runtime::Recording rec;
  bool ok = false;  // the recorded run raised nothing
  explicit RecordedRun(int lanes) {
    auto topo = plan::make_topology({"cpu"}, lanes, at::get_num_threads());
    plan::Plan p = round_robin(c.g, topo, lanes);
    ok = !runtime::execute(c.g, p, stream_places(lanes), nullptr, &rec).first_error;
  }
};

// The races the sanitizer reports when `replay` runs with its first event
// wait dropped (what orders the lanes: one dropped must be a race).
std::vector<std::string> races_with_a_dropped_wait(const std::function<void()>& replay) {
  runtime::inject_fault("drop_event_wait", 1);
  replay();
  runtime::inject_fault("drop_event_wait", 0);
  return runtime::take_stream_sanitizer_races();
}

TEST(Replay, ARecordedRunReplaysOverNewInputsWithNoRace) {
  RecordedRun run(3);
  ASSERT_TRUE(run.ok);
  auto& c = run.c;
  auto& rec = run.rec;
  ASSERT_EQ(rec.unreplayable, "");
  EXPECT_EQ(rec.inputs.size(), 3u);  // each leaf once, though mm reads it twice
  EXPECT_EQ(steps_of(rec, runtime::Recording::Step::Kind::Call), c.g.size());
  EXPECT_GT(steps_of(rec, runtime::Recording::Step::Kind::Wait), 0u);
  EXPECT_GT(rec.pool_bytes(), 0u);
  ASSERT_TRUE(c.result(rec).defined());
  EXPECT_TRUE(torch::allclose(c.result(rec), Replayable::eager(c.xs)));
  for (int round = 0; round < 3; ++round) {
    auto fresh = c.set_inputs(rec);
    const int64_t before = runtime::stream_sanitizer_accesses();
    runtime::replay(rec);
    EXPECT_GE(runtime::stream_sanitizer_accesses() - before, static_cast<int64_t>(c.g.size()));
    EXPECT_TRUE(torch::allclose(c.result(rec), Replayable::eager(fresh))) << round;
  }
  auto races = runtime::take_stream_sanitizer_races();
  EXPECT_TRUE(races.empty()) << races.front();
}

TEST(Replay, OwnInputsLeaveTheLeavesBytesAsTheyWere) {
  RecordedRun run(2);
  ASSERT_TRUE(run.ok);
  auto& c = run.c;
  auto& rec = run.rec;
  std::vector<const void*> leaves;
  for (const auto& [v, bytes] : rec.inputs) leaves.push_back(bytes.data());
  rec.own_inputs();
  ASSERT_EQ(rec.inputs.size(), leaves.size());
  for (size_t k = 0; k < leaves.size(); ++k) {
    EXPECT_NE(rec.inputs[k].second.data(), leaves[k]);
    EXPECT_EQ(rec.inputs[k].first.node->data.data(), leaves[k]);  // the run read the leaf's own bytes
  }
  // No step reads a leaf's own bytes any more.
  for (const auto& lane : rec.lanes)
    for (const auto& step : lane)
      for (const auto& s : step.reads) EXPECT_EQ(std::count(leaves.begin(), leaves.end(), s.data()), 0) << step.name;
  auto fresh = c.set_inputs(rec);
  runtime::replay(rec);
  EXPECT_TRUE(torch::allclose(c.result(rec), Replayable::eager(fresh)));
  for (size_t b = 0; b < c.xms.size(); ++b)
    EXPECT_TRUE(torch::equal(runtime::cpu_view(capture::buffer_of(c.xms[b])->value.node->data, capture::geometry_of(c.xms[b])),
                             c.xs[b]));
  auto races = runtime::take_stream_sanitizer_races();
  EXPECT_TRUE(races.empty()) << races.front();
}

TEST(Replay, ADroppedWaitInAReplayIsARaceNamingBothNodes) {
  RecordedRun run(3);
  ASSERT_TRUE(run.ok);
  auto& rec = run.rec;
  ASSERT_TRUE(runtime::take_stream_sanitizer_races().empty());
  auto races = races_with_a_dropped_wait([&] { runtime::replay(rec); });
  ASSERT_FALSE(races.empty());
  EXPECT_NE(races[0].find("write by node"), std::string::npos) << races[0];
  EXPECT_NE(races[0].find("read by node"), std::string::npos) << races[0];
}

// The order a CUDA graph's capture issues a recording in: every lane's
// steps from one thread, a lane stopping at a Wait whose Record is not
// queued yet. Over new inputs: eager's values, and no race.
TEST(Replay, IssuedFromOneThreadInTheCapturesOrderReplaysWithNoRace) {
  RecordedRun run(3);
  ASSERT_TRUE(run.ok);
  auto& c = run.c;
  auto& rec = run.rec;
  ASSERT_GT(steps_of(rec, runtime::Recording::Step::Kind::Wait), 0u);
  EXPECT_FALSE(runtime::can_capture(rec));  // CPU streams: no CUDA graph
  for (int round = 0; round < 3; ++round) {
    auto fresh = c.set_inputs(rec);
    const int64_t before = runtime::stream_sanitizer_accesses();
    runtime::replay_from_one_thread(rec);
    EXPECT_GE(runtime::stream_sanitizer_accesses() - before, static_cast<int64_t>(c.g.size()));
    EXPECT_TRUE(torch::allclose(c.result(rec), Replayable::eager(fresh))) << round;
  }
  auto races = runtime::take_stream_sanitizer_races();
  EXPECT_TRUE(races.empty()) << races.front();
  // ... and its waits are what orders the lanes: one dropped is a race.
  races = races_with_a_dropped_wait([&] { runtime::replay_from_one_thread(rec); });
  ASSERT_FALSE(races.empty());
  EXPECT_NE(races[0].find("write by node"), std::string::npos) << races[0];
}

// A recording whose lane waits for an event no lane records cannot be
// issued in any order: an error, not a hang, and every stream finishes.
TEST(Replay, ALaneWaitingForAnEventNoLaneRecordsIsAnError) {
  RecordedRun run(3);
  ASSERT_TRUE(run.ok);
  auto& rec = run.rec;
  for (auto& lane : rec.lanes)
    lane.erase(std::remove_if(lane.begin(), lane.end(),
                              [](const auto& s) { return s.kind == runtime::Recording::Step::Kind::Record; }),
               lane.end());
  try {
    runtime::replay_from_one_thread(rec);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("waits for an event no lane records"), std::string::npos)
        << e.what_without_backtrace();
  }
}

// The trial of a recorded graph's replay against its run without it
// (engine/replays.h), with the seconds each way took given: replay is kept
// where it measures faster, and dropped, saying why, where it does not.
TEST(Replay, ItsTrialKeepsReplayOnlyWhereItMeasuresFaster) {
  torch_mgpu::synchronize();  // no flight of earlier tests' work runs beside the sanitizer
  const int hits = engine::replay_hits();
  const bool trial = engine::replay_trial();
  engine::set_replay_hits(1);
  engine::set_replay_trial(true);
  for (const bool faster : {true, false}) {
    engine::clear_replays();
    Replayable c;
    auto topo = plan::make_topology({"cpu"}, 3, at::get_num_threads());
    plan::Plan p = round_robin(c.g, topo, 3);
    Sanitized on;
    engine::Lanes lanes{topo, stream_places(3), "round_robin"};
    const int64_t rejected = runtime::counters().replay_rejected.load();
    std::vector<int> ways;  // -1: counted or recorded, else the trial's way
    std::string last;
    for (int run_no = 0; run_no < 16; ++run_no) {
      engine::ReplayRun run;
      auto res = engine::run_replay(c.g, lanes, p, run);
      ways.push_back(run.way);
      last = run.why + "|" + run.note;
      if (run.way >= 0) engine::observe_replay(run, run.way == 1 ? (faster ? 1e-3 : 3e-3) : 2e-3);
      if (run.replayed) EXPECT_TRUE(res.has_value());
    }
    // Counted, recorded, then both ways in turns (replay's first run cold)
    // until each has 3 timed runs: 7 runs on trial.
    ASSERT_EQ(std::vector<int>(ways.begin(), ways.begin() + 2), (std::vector<int>{-1, -1}));
    EXPECT_EQ(std::count(ways.begin() + 2, ways.begin() + 9, 1), 4) << faster;
    EXPECT_EQ(std::count(ways.begin() + 2, ways.begin() + 9, 0), 3) << faster;
    EXPECT_EQ(std::count(ways.begin() + 9, ways.end(), 0), 0) << faster;
    if (faster) {
      EXPECT_NE(last.find("kept after its trial: replayed 1.0"), std::string::npos) << last;
      EXPECT_EQ(runtime::counters().replay_rejected.load(), rejected);
    } else {
      EXPECT_NE(last.find("slower than its run without replay in its trial: replayed 3.0"), std::string::npos) << last;
      EXPECT_EQ(runtime::counters().replay_rejected.load(), rejected + 1);
    }
  }
  engine::clear_replays();
  engine::set_replay_hits(hits);
  engine::set_replay_trial(trial);
  auto races = runtime::take_stream_sanitizer_races();
  EXPECT_TRUE(races.empty()) << races.front();
}

TEST(Replay, APartReplaysAsOneCall) {
  torch_mgpu::synchronize();  // no flight of earlier tests' work runs beside the sanitizer
  PartsCase pc;
  Sanitized on;
  runtime::Recording rec;
  runtime::ExecResult r = runtime::execute(pc.g, pc.p, stream_places(2), &pc.parts, &rec);
  ASSERT_FALSE(r.first_error);
  ASSERT_EQ(rec.unreplayable, "");
  EXPECT_EQ(pc.calls, 2);
  EXPECT_EQ(steps_of(rec, runtime::Recording::Step::Kind::Call), 3u);  // two parts and the sum
  ASSERT_EQ(rec.inputs.size(), 1u);
  auto fresh = torch::randn({32, 32});
  runtime::cpu_view(rec.inputs[0].second, capture::geometry_of(pc.x)).copy_(fresh);
  runtime::replay(rec);
  EXPECT_EQ(pc.calls, 4);
  ASSERT_EQ(rec.outputs.size(), 1u);
  auto want = torch::tanh(torch::mm(fresh, fresh)) + torch::sigmoid(fresh) * 2.5;
  EXPECT_TRUE(torch::allclose(runtime::cpu_view(rec.outputs[0].second, capture::geometry_of(pc.sum_m)), want));
  auto races = runtime::take_stream_sanitizer_races();
  EXPECT_TRUE(races.empty()) << races.front();
}

TEST(Replay, ARunOffStreamLanesOrThatFailedIsNotReplayable) {
  torch_mgpu::synchronize();  // no flight of earlier tests' work runs beside the sanitizer
  Replayable c;
  auto topo = plan::make_topology({"cpu"}, 2, at::get_num_threads());
  plan::Plan p = round_robin(c.g, topo, 2);
  runtime::Recording rec;
  runtime::ExecResult r = runtime::execute(c.g, p, {runtime::Place(), runtime::Place()}, nullptr, &rec);
  ASSERT_FALSE(r.first_error);
  EXPECT_NE(rec.unreplayable.find("lane 0 is not a stream lane"), std::string::npos) << rec.unreplayable;
  EXPECT_TRUE(rec.lanes[0].empty() && rec.lanes[1].empty());
  try {
    runtime::replay(rec);
    ADD_FAILURE() << "replayed a run of host lanes";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be replayed: lane 0 is not a stream lane"), std::string::npos);
  }
  PartsCase pc;
  pc.fail_second = true;
  Sanitized on;
  runtime::ExecResult failed = runtime::execute(pc.g, pc.p, stream_places(2), &pc.parts, &rec);
  ASSERT_TRUE(failed.first_error);
  EXPECT_EQ(rec.unreplayable, "a node failed");
}

} // namespace

TEST(StreamLanes, FactorizationsThatLoadCudaKernelsAreKnownByName) {
  using torch_mgpu::runtime::may_load_cuda_linalg;
  for (const char* name : {"aten::linalg_solve", "aten::_linalg_solve_ex", "aten::_linalg_svd", "aten::det",
                           "aten::linalg_eigh", "aten::cholesky_solve", "aten::_cholesky_solve_helper",
                           "aten::lu_solve", "aten::triangular_solve", "aten::geqrf", "aten::ormqr",
                           "aten::linalg_lstsq.grad", "torch_mgpu::partition", "mylib::custom"})
    EXPECT_TRUE(may_load_cuda_linalg(name)) << name;
  for (const char* name : {"aten::add.Tensor", "aten::relu", "aten::detach", "aten::mm", "aten::lerp.Scalar",
                           "aten::solver_x", "data"})
    EXPECT_FALSE(may_load_cuda_linalg(name)) << name;
}

// What keeps a plan from being captured and replayed is known from the
// graph, its plan and the lanes, before any capture (runtime/replay.h).
TEST(Replay, WhatCannotBeCapturedIsKnownBeforeCapture) {
  Captured c = branches();
  auto topo = plan::make_topology({"cpu"}, 3, at::get_num_threads());
  plan::Plan p = round_robin(c.graph, topo, 3);
  auto places = stream_places(3);
  EXPECT_EQ(runtime::replay_blocker(c.graph, p, places), std::nullopt);
  // A host lane among them.
  auto mixed = places;
  mixed[1] = runtime::Place();
  auto why = runtime::replay_blocker(c.graph, p, mixed);
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("lane 1 is a host lane"), std::string::npos) << *why;
  // Lanes on two devices (a stream lane's device only read, nothing runs).
  auto two = places;
  two[2].device = c10::Device(c10::kCUDA, 1);
  two[2].stream = c10::Stream(c10::Stream::UNSAFE, two[2].device, 7);
  why = runtime::replay_blocker(c.graph, p, two);
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("more than one device"), std::string::npos) << *why;
  // On a GPU's streams, an op with no kernel there would run on the host
  // (this build has no CUDA kernels at all; a CUDA build has them for mm).
  auto gpu = places;
  for (auto& pl : gpu) {
    pl.device = c10::Device(c10::kCUDA, 0);
    pl.stream = c10::Stream(c10::Stream::UNSAFE, pl.device, 3);
  }
  why = runtime::replay_blocker(c.graph, p, gpu);
  const bool cuda_kernels = c10::Dispatcher::singleton().findOp({"aten::mm", ""})->hasComputedKernelForDispatchKey(
      c10::DispatchKey::CUDA);
  if (cuda_kernels) {
    EXPECT_EQ(why, std::nullopt) << *why;
  } else {
    ASSERT_TRUE(why);
    EXPECT_NE(why->find("has no kernel for cuda:0: it would run on the host"), std::string::npos) << *why;
  }
  // The pool: what the graph makes, against its bound.
  size_t made = 0;
  for (const auto& n : c.graph.nodes)
    for (const auto& o : n->outputs) made += o.nbytes;
  runtime::ReplayLimits small;
  small.pool_bytes = made - 1;
  why = runtime::replay_blocker(c.graph, p, places, small);
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("more than a graph's pool holds"), std::string::npos) << *why;
  small.pool_bytes = made;
  EXPECT_EQ(runtime::replay_blocker(c.graph, p, places, small), std::nullopt);
}

// An op whose CUDA kernel reads a value on the host (a sync, which a
// capture refuses) keeps the graph from capture, known before it: on a
// GPU's lanes only, by name, and for the _ex forms and histc by the
// arguments that make them read.
TEST(Replay, AnOpThatReadsOnTheHostOnAGpuKeepsItsGraphFromCapture) {
  auto x = torch::randn({8, 8}).to(torch_mgpu::device());
  auto spd = torch::matmul(x, x.t()) + torch::eye(8).to(torch_mgpu::device());
  auto gpu = stream_places(2);
  for (auto& pl : gpu) {
    pl.device = c10::Device(c10::kCUDA, 0);
    pl.stream = c10::Stream(c10::Stream::UNSAFE, pl.device, 3);
  }
  auto topo = plan::make_topology({"cpu"}, 2, at::get_num_threads());
  auto blocker = [&](const at::Tensor& y, const std::vector<runtime::Place>& places) {
    ir::Graph g = ir::build_graph({capture::buffer_of(y)->value});
    return runtime::capture_blocker(g, round_robin(g, topo, 2), places);
  };
  auto why = blocker(std::get<0>(torch::linalg_eigh(spd)) * 2, gpu);
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("eigh"), std::string::npos) << *why;
  EXPECT_NE(why->find("checks its result on the host on cuda:0"), std::string::npos) << *why;
  EXPECT_EQ(blocker(std::get<0>(torch::linalg_eigh(spd)) * 2, stream_places(2)), std::nullopt);  // CPU streams
  EXPECT_EQ(blocker(torch::tanh(spd) + 1, gpu), std::nullopt);
  // linalg.cholesky and linalg.inv replay unchecked, their checks left to
  // the replay's end (Replay.AFailedCheck...): nothing against capture.
  EXPECT_EQ(blocker(torch::linalg_cholesky(spd) * 2, gpu), std::nullopt);
  EXPECT_EQ(blocker(torch::linalg_inv(spd) * 2, gpu), std::nullopt);
  why = blocker(std::get<0>(torch::linalg_cholesky_ex(spd, false, /*check_errors=*/true)), gpu);
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("check_errors=True"), std::string::npos) << *why;
  EXPECT_EQ(blocker(std::get<0>(torch::linalg_cholesky_ex(spd, false, /*check_errors=*/false)), gpu), std::nullopt);
  why = blocker(torch::histc(x, 8), gpu);
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("range on the host (min == max)"), std::string::npos) << *why;
  EXPECT_EQ(blocker(torch::histc(x, 8, -3, 3), gpu), std::nullopt);
  torch_mgpu::synchronize();
}

// linalg.cholesky's check of its result (a host sync) is left to the end
// of a replay: the recorded call is linalg_cholesky_ex with no check, its
// error codes in bytes of the recording's, read once the replay is done.
TEST(Replay, AFailedCheckLeftToTheReplaysEndIsRaisedAfterIt) {
  torch_mgpu::synchronize();  // no flight of earlier tests' work runs beside the sanitizer
  auto m = torch::randn({6, 6});
  auto spd = torch::matmul(m, m.t()) + 6 * torch::eye(6);
  auto am = spd.to(torch_mgpu::device());
  auto l = torch::linalg_cholesky(am) * 2;
  ir::Graph g = ir::build_graph({capture::buffer_of(l)->value});
  auto topo = plan::make_topology({"cpu"}, 2, at::get_num_threads());
  plan::Plan p = round_robin(g, topo, 2);
  Sanitized on;
  runtime::Recording rec;
  ASSERT_FALSE(runtime::execute(g, p, stream_places(2), nullptr, &rec).first_error);
  ASSERT_EQ(rec.checks.size(), 1u);
  EXPECT_NE(rec.checks[0].node.find("aten::linalg_cholesky"), std::string::npos) << rec.checks[0].node;
  ASSERT_EQ(rec.inputs.size(), 1u);
  rec.own_inputs();  // (a replay's inputs are never the leaf's own bytes)
  auto input = runtime::cpu_view(rec.inputs[0].second, capture::geometry_of(am));
  auto result = [&] {
    for (const auto& [v, bytes] : rec.outputs)
      if (v.node == capture::buffer_of(l)->value.node) return runtime::cpu_view(bytes, capture::geometry_of(l));
    return at::Tensor();
  };
  input.copy_(spd);
  runtime::replay(rec);
  EXPECT_NO_THROW(runtime::raise_failed_checks(rec));
  EXPECT_TRUE(torch::allclose(result(), torch::linalg_cholesky(spd) * 2));
  input.copy_(-torch::eye(6));  // not positive-definite
  runtime::replay(rec);
  try {
    runtime::raise_failed_checks(rec);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("failed its check in a replay (error code 1)"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  auto races = runtime::take_stream_sanitizer_races();
  EXPECT_TRUE(races.empty()) << races.front();
}

// A seeded random op would draw the same numbers at every replay.
TEST(Replay, RandomOpsAreNotCaptured) {
  auto x = torch::randn({16, 16}).to(torch_mgpu::device());
  auto y = torch::dropout(torch::tanh(x), 0.5, /*train=*/true);
  ir::Graph g = ir::build_graph({capture::buffer_of(y)->value});
  auto topo = plan::make_topology({"cpu"}, 2, at::get_num_threads());
  plan::Plan p = round_robin(g, topo, 2);
  auto why = runtime::replay_blocker(g, p, stream_places(2));
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("draws random numbers"), std::string::npos) << *why;
  torch_mgpu::synchronize();
}
