// Lanes of this process in one execution (run.h): a lane's nodes in plan
// order, each run where its place says (a host thread, a stream), fused
// groups as one pass, failures kept to the node that raised.
#include "runtime/run.h"

#include <array>

namespace torch_mgpu::runtime::detail {

void Run::run_one(int lane, int i) {
  const ir::Node& node = *g.nodes[i];
  const Place& place = places[lane];
  std::unique_lock<std::mutex> lock(m);
  wait_for_producers(lock, std::array<int, 1>{i}, [](int) { return true; }, [](int n) { return n; });
  std::vector<c10::Storage> operands;
  operands.reserve(node.operands.size());
  for (size_t k = 0; k < node.operands.size(); ++k) {
    if (skip_if_missing(i, k)) return;
    const ir::Value& v = node.operands[k];
    const int d = producer[operand_at[i] + k];
    try {
      operands.push_back(operand(v, d, lane, lock));  // returns (or throws) with the lock held
    } catch (const std::exception& e) {
      observers().node_failed();
      fail(i, Status::Failed, std::current_exception(), message_of(e));
      cv.notify_all();
      return;
    }
  }
  lock.unlock();
  // A materialized value's copy on another device is shared by every
  // later read there: a node never writes it in place (a kernel failing
  // part-way would leave the copies disagreeing).
  const std::vector<bool>* reuse = &p.reuse[i];
  std::vector<bool> no_replica_reuse;
  for (const auto& o : node.outputs) {
    const int k = o.mutated_operand;
    if (k < 0 || !(*reuse)[k] || producer[operand_at[i] + k] >= 0) continue;
    const ir::Node& leaf_node = *node.operands[k].node;
    if (leaf_node.kind != ir::NodeKind::Data || operands[k].unsafeGetStorageImpl() == leaf_node.data.unsafeGetStorageImpl())
      continue;
    if (no_replica_reuse.empty()) no_replica_reuse = *reuse;
    no_replica_reuse[k] = false;
    reuse = &no_replica_reuse;
  }
  std::optional<ScopedParallelism> narrow;
  if (node.call_threads > 0 && place.device.is_cpu()) {
    // Its kernel rounds by its thread count: the caller's, as in eager.
    if (node.call_threads != thread_parallelism()) narrow.emplace(node.call_threads);
  } else if (!p.one_thread.empty() && p.one_thread[i]) {
    narrow.emplace(1);
  }
  NodeTiming timing;
  timing.lane = lane;
  timing.threads = thread_parallelism();
  timing.start = now();
  std::vector<c10::Storage> out;
  std::exception_ptr error;
  std::string message;
  try {
    // Every failure of the node's own work, on the host or on its stream,
    // is the node's error: waits for other lanes, the allocator's record
    // of its operands, the kernel, the event after it.
    if (place.on_stream()) order_on_stream(lane, g.deps[i], operands);
    observers().before_node(node);
    std::vector<c10::Storage> read;
    if (recording) read = operands;
    out = run_node(node, std::move(operands), *reuse, place);
    if (recording) record_call(lane, i, std::move(read), out, *reuse);
    if (events[i]) record_event(lane, i);
    if (place.on_stream()) {
      ends[i].emplace(place.device.type(), c10::EventFlag::BACKEND_DEFAULT);
      ends[i]->record(place.stream);
    }
  } catch (const std::exception& e) {
    error = std::current_exception();
    message = message_of(e);
  }
  timing.end = now();
  lock.lock();
  res.timing[i] = timing;
  if (error) {
    observers().node_failed();
    fail(i, Status::Failed, error, message);
  } else {
    for (const auto& o : out) ir::hold(o);
    res.values[i] = std::move(out);
    res.status[i] = Status::Ok;
    release_operands(i);
  }
  lock.unlock();
  if (parallel) cv.notify_all();
}

std::vector<c10::Storage> call_part(const Part& part, const std::vector<c10::Storage>& reads, const Place& place) {
  std::vector<const void*> written;
  std::vector<c10::Storage> made = part.call(reads, place, written);
  TORCH_CHECK(made.size() == part.makes.size(), "mgpu: ", part.name, " returned ", made.size(), " values, expected ",
              part.makes.size());
  if (place.on_stream() && observers().watches_streams()) {
    std::vector<const void*> read;
    for (const auto& s : reads) read.push_back(s.data());
    observers().stream_access(place.device, part.name, read, written, false);
  }
  return made;
}

void Run::record_call(int lane, int i, std::vector<c10::Storage> read, const std::vector<c10::Storage>& made,
                      const std::vector<bool>& reuse) {
  Recording::Step call;
  call.name = "node " + std::to_string(g.nodes[i]->id) + " (" + std::string(g.nodes[i]->name) + ")";  // as run_node reports it
  call.reads = std::move(read);
  call.writes = made;
  // A check that reads the result on the host is left to the replay's end:
  // the call's error codes go to bytes of the recording's.
  ir::NodePtr node = unchecked_call_of(*g.nodes[i]);
  c10::Storage codes;
  if (node) {
    codes = allocate(node->outputs.back().nbytes, places[lane].device);
    recording->checks.push_back({codes, describe_node(*g.nodes[i])});
  } else {
    node = call_of(*g.nodes[i]);
  }
  // With the intra-op threads it ran with (a CPU kernel rounds by them).
  call.call = [node, codes, reuse, threads = thread_parallelism()](const std::vector<c10::Storage>& r,
                                                                   const Place& at) {
    std::optional<ScopedParallelism> narrow;
    if (at.device.is_cpu() && threads != thread_parallelism()) narrow.emplace(threads);
    observers().before_node(*node);
    std::vector<c10::Storage> out = run_node(*node, r, reuse, at);
    if (codes) {
      if (codes.nbytes()) byte_view(codes, codes.nbytes()).copy_(byte_view(out.back(), codes.nbytes()), true);
      out.pop_back();
    }
    return out;
  };
  recording->lanes[lane].push_back(std::move(call));
}

void Run::record_event(int lane, int i) {
  events[i]->record(places[lane].stream);
  if (!recording) return;
  Recording::Step rec;
  rec.kind = Recording::Step::Kind::Record;
  rec.event = i;
  recording->lanes[lane].push_back(std::move(rec));
}

void Run::release_operands(int i) {
  const ir::Node& node = *g.nodes[i];
  for (size_t k = 0; k < node.operands.size(); ++k) {
    const ir::Value& v = node.operands[k];
    const int d = producer[operand_at[i] + k];
    if (d < 0) continue;
    // (A worker's value another worker read straight from it may not be
    // reported here yet: its stand-in is released with the run's.)
    if (--readers[output_at[d] + v.index] == 0 && !is_root[output_at[d] + v.index] &&
        static_cast<size_t>(v.index) < res.values[d].size()) {
      ir::release(res.values[d][v.index]);
      res.values[d][v.index] = c10::Storage();
      if (!copies.empty())
        for (int dev = 0; dev < static_cast<int>(p.lanes.size()); ++dev) {
          auto c = copies.find(std::make_tuple(d, v.index, dev));
          if (c == copies.end()) continue;
          ir::release(c->second.bytes);
          copies.erase(c);
        }
    }
  }
}

void Run::run_group(int lane, const plan::FusedGroup& grp) {
  const Place& place = places[lane];
  const int id = p.fusion.group_of[grp.steps[0].node];
  auto outside = [&](int d) { return p.fusion.group_of[d] != id; };
  auto one_by_one = [&] {
    for (const auto& s : grp.steps) run_one(lane, s.node);
  };
  std::unique_lock<std::mutex> lock(m);
  wait_for_producers(lock, grp.steps, outside, [](const auto& s) { return s.node; });
  const size_t elem = c10::elementSize(grp.dtype);
  std::vector<c10::Storage> held;  // keeps the external bytes alive
  std::vector<const void*> external;
  held.reserve(grp.externals.size());
  external.reserve(grp.externals.size());
  for (const auto& e : grp.externals) {
    const ir::Node& node = *g.nodes[e.node];
    const auto& ref = *node.args[e.arg].tensors[0];
    const ir::Value& v = node.operands[ref.operand];
    const int d = producer[operand_at[e.node] + ref.operand];
    if (missing(v, d)) {
      lock.unlock();
      held.clear();
      one_by_one();
      return;
    }
    c10::Storage bytes;
    try {
      bytes = operand(v, d, lane, lock);  // returns (or throws) with the lock held
    } catch (const std::exception& ex) {
      // Its transfer failed: the group fails with that error.
      observers().node_failed();
      for (const auto& step : grp.steps) fail(step.node, Status::Failed, std::current_exception(), message_of(ex));
      lock.unlock();
      cv.notify_all();
      return;
    }
    external.push_back(static_cast<const char*>(bytes.data()) + ref.geom.offset * elem);
    held.push_back(std::move(bytes));
  }
  lock.unlock();
  const double start = now();
  std::vector<c10::Storage> outputs(grp.steps.size());
  std::vector<void*> out(grp.steps.size(), nullptr);
  std::exception_ptr error;
  std::string message;
  try {
    RECORD_FUNCTION("mgpu::fused_pointwise", std::vector<c10::IValue>());
    for (const auto& step : grp.steps) observers().before_node(*g.nodes[step.node]);
    for (size_t k = 0; k < grp.steps.size(); ++k) {
      if (!grp.steps[k].materialize) continue;
      outputs[k] = allocate(g.nodes[grp.steps[k].node]->outputs[0].nbytes, place.device);
      out[k] = outputs[k].mutable_data();
    }
    run_pointwise(g, grp, external, out);
  } catch (const std::exception& e) {
    error = std::current_exception();
    message = message_of(e);
  }
  held.clear();
  const double end = now();
  const double each = (end - start) / static_cast<double>(grp.steps.size());
  lock.lock();
  for (size_t k = 0; k < grp.steps.size(); ++k) {
    const int i = grp.steps[k].node;
    // Per-node times: the group's time shared out evenly.
    res.timing[i] = NodeTiming{lane, start + each * static_cast<double>(k), start + each * static_cast<double>(k + 1),
                               thread_parallelism()};
    if (error) {
      fail(i, Status::Failed, error, message);
      continue;
    }
    ir::hold(outputs[k]);
    res.values[i] = {std::move(outputs[k])};
    res.status[i] = Status::Ok;
  }
  if (error) {
    observers().node_failed();
  } else {
    for (const auto& s : grp.steps) release_operands(s.node);
    observers().nodes_ran(static_cast<int64_t>(grp.steps.size()));
  }
  lock.unlock();
  if (parallel) cv.notify_all();
}

void Run::run_part(int lane, const Part& part) {
  const Place& place = places[lane];
  const int id = parts->part_of[part.nodes.at(0)];
  auto outside = [&](int d) { return parts->part_of[d] != id; };
  std::unique_lock<std::mutex> lock(m);
  wait_for_producers(lock, part.nodes, outside, [](int n) { return n; });
  // Its nodes fail (or are skipped) together.
  auto fail_all = [&](Status s, std::exception_ptr e, const std::string& msg) {
    for (int i : part.nodes) fail(i, s, e, msg);
    cv.notify_all();
  };
  std::vector<c10::Storage> reads;
  reads.reserve(part.reads.size());
  for (const auto& [v, d] : part.reads) {
    if (missing(v, d)) {
      fail_all(Status::Skipped, skipped_by(v, d), d < 0 ? v.node->error : "");
      return;
    }
    try {
      reads.push_back(operand(v, d, lane, lock));  // returns (or throws) with the lock held
    } catch (const std::exception& e) {
      observers().node_failed();
      fail_all(Status::Failed, std::current_exception(), message_of(e));
      return;
    }
  }
  lock.unlock();
  const double start = now();
  std::vector<c10::Storage> made;
  std::exception_ptr error;
  std::string message;
  try {
    if (place.on_stream()) {
      // After the other lanes' producers of what it reads, as a node.
      std::vector<int> producers;
      for (int i : part.nodes)
        for (int d : g.deps[i])
          if (outside(d)) producers.push_back(d);
      order_on_stream(lane, producers, reads);
    }
    made = call_part(part, reads, place);
    if (place.on_stream()) {
      if (recording) {
        Recording::Step call;
        call.name = part.name;
        call.reads = reads;
        call.writes = made;
        call.call = [part](const std::vector<c10::Storage>& r, const Place& at) { return call_part(part, r, at); };
        recording->lanes[lane].push_back(std::move(call));
      }
      for (int i : part.nodes) {
        if (events[i]) record_event(lane, i);
        ends[i].emplace(place.device.type(), c10::EventFlag::BACKEND_DEFAULT);
        ends[i]->record(place.stream);
      }
    }
  } catch (const std::exception& e) {
    error = std::current_exception();
    message = message_of(e);
  }
  reads.clear();
  const double end = now();
  lock.lock();
  for (int i : part.nodes) {
    res.timing[i] = NodeTiming{lane, start, end, thread_parallelism()};
    if (error) {
      fail(i, Status::Failed, error, message);
      continue;
    }
    res.values[i].resize(g.nodes[i]->outputs.size());
    res.status[i] = Status::Ok;
  }
  if (error) {
    observers().node_failed();
  } else {
    for (size_t j = 0; j < made.size(); ++j) {
      const auto [i, k] = part.makes[j];
      ir::hold(made[j]);
      res.values[i].at(k) = std::move(made[j]);
    }
    for (int i : part.nodes) release_operands(i);
  }
  lock.unlock();
  if (parallel) cv.notify_all();
}

void Run::fail_unexpected(int i, std::exception_ptr e) {
  std::string msg = "an error in the executor";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    msg = message_of(ex);
  } catch (...) {
  }
  {
    std::lock_guard<std::mutex> lock(m);
    if (res.status[i] != Status::NotRun) return;
    observers().node_failed();
    fail(i, Status::Failed, e, msg);
  }
  cv.notify_all();
}

void Run::device_times(int l, const c10::Event& start, double start_s) {
  std::vector<std::pair<int, double>> end_of;
  try {
    for (int i : p.lane_order[l])
      if (ends[i]) end_of.emplace_back(i, start_s + start.elapsedTime(*ends[i]) / 1000.0);
  } catch (const std::exception&) {
    return;
  }
  std::lock_guard<std::mutex> lock(m);
  double previous = start_s;
  for (const auto& [i, end] : end_of) {
    NodeTiming& t = res.timing[i];
    t.start = std::max(t.start, previous);
    t.end = std::max(end, t.start);
    previous = t.end;
  }
}

void Run::run_lane(int l) noexcept {
  try {
    switch (places[l].kind) {
      case LaneKind::Host:
        run_host_lane(l);
        break;
      case LaneKind::Stream:
        run_stream_lane(l);
        break;
      case LaneKind::Remote:
        TORCH_INTERNAL_ASSERT(false, "mgpu: a remote lane runs as a program (remote_lanes.cpp)");
    }
  } catch (...) {
    // Setting the lane up failed (its stream guard on a device in error):
    // its nodes fail.
    for (int i : p.lane_order[l]) fail_unexpected(i, std::current_exception());
  }
}

void Run::run_host_lane(int l) {
  HostCacheScope host_memory;  // kernels' large outputs reuse freed blocks
  run_in_order(l, /*fuse=*/!p.fusion.group_at.empty());  // host kernels over host memory
}

void Run::run_stream_lane(int l) {
  const Place& place = places[l];
  HostCacheScope host_memory;
  c10::StreamGuard guard(place.stream);
  const auto& order = p.lane_order[l];
  if (order.empty()) return;
  // The device's clock for this lane's nodes starts here.
  c10::Event lane_start(place.device.type(), c10::EventFlag::BACKEND_DEFAULT);
  lane_start.record(place.stream);
  const double lane_start_s = now();
  run_in_order(l, /*fuse=*/false);
  try {
    observers().before_stream_sync();
    place.stream.synchronize();
    observers().lane_done();
    device_times(l, lane_start, lane_start_s);
  } catch (const std::exception& e) {
    // The device reported an error for work queued on this stream; which
    // kernel failed it cannot say. The run raises it at the sync; values
    // keep whatever the device left (a device in this state fails every
    // later call anyway).
    std::lock_guard<std::mutex> lock(m);
    observers().node_failed();
    if (!res.first_error) {
      res.first_message = "mgpu: synchronizing " + p.lanes[l].name + " after " + std::string(g.nodes[order.back()]->name) +
          " failed: " + message_of(e);
      res.first_error = error_with(res.first_message);
    }
  }
}

void Run::run_in_order(int l, bool fuse) {
  const auto& order = p.lane_order[l];
  const auto& f = p.fusion;
  for (size_t k = 0; k < order.size(); ++k) {
    const int part = parts ? parts->part_at[order[k]] : -1;
    const int grp = fuse && part < 0 ? f.group_at[order[k]] : -1;
    // A part's nodes, and a group's steps, are the lane's next nodes.
    const size_t steps = part >= 0 ? parts->parts[part].nodes.size() : grp < 0 ? 1 : f.groups[grp].steps.size();
    try {
      if (part >= 0) run_part(l, parts->parts[part]);
      else if (grp < 0) run_one(l, order[k]);
      else run_group(l, f.groups[grp]);
    } catch (...) {
      for (size_t s = 0; s < steps; ++s) fail_unexpected(order[k + s], std::current_exception());
    }
    k += steps - 1;
  }
}

} // namespace torch_mgpu::runtime::detail
