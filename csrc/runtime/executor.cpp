// runtime::execute: one plan run on its lanes (the state they share and
// the steps by where they run: run.h), and ExecResult.
#include "runtime/executor.h"
#include "runtime/run.h"

#include <ATen/ops/linalg_cholesky_ex.h>
#include <ATen/ops/ones.h>
#include <c10/core/DeviceGuard.h>
#include <algorithm>

namespace torch_mgpu::runtime {

namespace detail {

Run::Run(const ir::Graph& graph, const plan::Plan& plan, const std::vector<Place>& pl, ExecResult& r)
    : g(graph), p(plan), places(pl), res(r) {
  TORCH_INTERNAL_ASSERT(places.size() >= p.lanes.size(), "mgpu: a place is needed for every lane");
  const size_t n = g.size();
  operand_at.resize(n + 1);
  output_at.resize(n + 1);
  for (size_t i = 0; i < n; ++i) {
    operand_at[i + 1] = operand_at[i] + static_cast<int>(g.nodes[i]->operands.size());
    output_at[i + 1] = output_at[i] + static_cast<int>(g.nodes[i]->outputs.size());
  }
  producer.assign(operand_at[n], -1);
  readers.assign(output_at[n], 0);
  is_root.assign(output_at[n], 0);
  events.resize(n);
  ends.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const auto& ops = g.nodes[i]->operands;
    for (size_t k = 0; k < ops.size(); ++k) {
      const int d = g.find(ops[k].node.get());
      producer[operand_at[i] + k] = d;
      if (d < 0) continue;
      readers[output_at[d] + ops[k].index]++;
      const Place& from = places[p.lane_of[d]];
      if (from.on_stream() && p.lane_of[d] != p.lane_of[i] && !events[d]) events[d].emplace(from.device.type());
    }
  }
  for (const auto& r2 : g.roots) {
    const int d = g.find(r2.node.get());
    if (d >= 0) is_root[output_at[d] + r2.index] = 1;
  }
  bool remote = false;
  for (size_t l = 0; l < p.lanes.size(); ++l) remote |= places[l].is_remote();
  if (remote) {
    remote_slot.assign(output_at[n], -1);
    exported.assign(output_at[n], 0);
    for (size_t k = 0; k < exported.size(); ++k) exported[k] = is_root[k] ? 2 : 0;
    forward.assign(output_at[n], {});
    for (size_t i = 0; i < n; ++i)
      for (size_t k = 0; k < g.nodes[i]->operands.size(); ++k) {
        const int d = producer[operand_at[i] + k];
        if (d < 0 || p.lane_of[d] == p.lane_of[i]) continue;
        const int out = output_at[d] + g.nodes[i]->operands[k].index;
        const int to = rank_of(p.lane_of[i]);
        // Straight between two workers, both answering (a rank that is
        // lost, though perhaps alive, would leave the other waiting: its
        // values go through this process, which fails them at once).
        if (rank_of(p.lane_of[d]) && to && !places[p.lane_of[d]].remote->lost() &&
            !places[p.lane_of[i]].remote->lost()) {
          if (std::find(forward[out].begin(), forward[out].end(), to) == forward[out].end()) forward[out].push_back(to);
        } else {
          exported[out] = 1;
        }
      }
  }
}

void Run::fail(int i, Status s, std::exception_ptr e, const std::string& msg) {
  res.status[i] = s;
  std::string m = msg;
  if (s == Status::Failed && e) {
    e = with_node_context(*g.nodes[i], e);
    m = msg + " (raised by " + describe_node(*g.nodes[i]) + ")";
  }
  if (!m.empty()) res.messages[i] = m;
  // The sync raises the error of the failed op the program called first,
  // as eager would have stopped there, whatever order the lanes ran in.
  if (e && (!res.first_error || g.nodes[i]->id < first_id)) {
    res.first_error = e;
    res.first_message = m;
    first_id = g.nodes[i]->id;
  }
}

c10::Storage Run::leaf(const ir::Node& n, const Place& place) {
  if (n.kind == ir::NodeKind::Empty) {
    // Uninitialized, yet one value: every reader sees the same bytes.
    return n.replica_or(place.device, [&](const c10::Storage* any) {
      return any ? copy_to(*any, place.device, /*wait=*/true) : allocate(n.outputs[0].nbytes, place.device);
    });
  }
  if (n.data.device() == place.device) return n.data;
  if (auto r = n.replica(place.device)) return r;
  // Made under the lock (once per device, the first time a device reads
  // it) and complete on return: the copy is kept and read on any stream.
  observers().before_transfer();
  c10::Storage moved = copy_to(n.data, place.device, /*wait=*/true);
  if (place.on_stream())
    observers().stream_access(place.device, "the copy of data node " + std::to_string(n.id) + " to " + place.device.str(),
                              {n.data.data()}, {moved.data()}, /*synchronous=*/true);
  observers().transferred(moved.nbytes());
  n.add_replica(moved);
  return moved;
}

c10::Storage Run::operand(const ir::Value& v, int d, int lane, std::unique_lock<std::mutex>& lock) {
  const Place& place = places[lane];
  if (d < 0) {
    c10::Storage bytes = leaf(*v.node, place);
    if (recording) record_input(v, bytes);
    return bytes;
  }
  const int src_lane = p.lane_of[d];
  const int device = p.lanes[lane].device;
  c10::Storage src = res.values[d][v.index];
  if (p.lanes[src_lane].device == device) return src;
  if (recording && recording->unreplayable.empty()) recording->unreplayable = "a value crossed devices";
  // Sent back by another rank's lane: already a copy in host memory.
  if (places[src_lane].is_remote() && src.device() == place.device) return src;
  auto key = std::make_tuple(d, v.index, device);
  auto [c, first] = copies.try_emplace(key);
  if (!first) {
    // Made, or being made, by another lane of this device: wait for it.
    cv.wait(lock, [&] { return c->second.done; });
    TORCH_CHECK(static_cast<bool>(c->second.bytes), "mgpu: copying a value to ", place.device, " failed");
    if (c->second.ready && c->second.lane != lane) {
      observers().before_event_wait();
      c->second.ready->block(place.stream);
    }
    return c->second.bytes;
  }
  lock.unlock();
  Copy moved;
  moved.lane = lane;
  try {
    // A device-to-device copy is queued after the producer on its stream;
    // this lane's stream (current for its device) waits for the copy.
    std::optional<c10::StreamGuard> on_producer;
    if (places[src_lane].on_stream()) on_producer.emplace(places[src_lane].stream);
    observers().before_transfer();
    moved.bytes = copy_to(src, place.device);
    if (places[src_lane].on_stream()) {
      observers().stream_access(places[src_lane].device,
                                "the copy of node " + std::to_string(g.nodes[d]->id) + "'s value to " +
                                    place.device.str(),
                                {src.data()}, {moved.bytes.data()}, /*synchronous=*/false);
      // The copy is queued on the producer's stream: this lane's stream
      // waits for it through an event of ours (ATen's device-to-device
      // copy also orders it with the destination's current stream, both
      // ways; the way back, the copy after the destination block's own
      // stream, is still ATen's).
      if (place.on_stream()) {
        c10::Event copied(places[src_lane].device.type());
        copied.record(places[src_lane].stream);
        copied.block(place.stream);
      }
    }
    on_producer.reset();
    if (place.on_stream()) {
      moved.ready = std::make_shared<c10::Event>(place.device.type());
      moved.ready->record(place.stream);
    }
  } catch (...) {
    lock.lock();  // the caller expects the lock back, and waiters an answer
    c->second.done = true;
    cv.notify_all();
    throw;
  }
  observers().transferred(moved.bytes.nbytes());
  ir::hold(moved.bytes);
  moved.done = true;
  lock.lock();
  c->second = std::move(moved);
  cv.notify_all();
  return c->second.bytes;
}

bool Run::skip_if_missing(int i, size_t k) {
  const ir::Value& v = g.nodes[i]->operands[k];
  const int d = producer[operand_at[i] + k];
  if (!missing(v, d)) return false;
  fail(i, Status::Skipped, skipped_by(v, d), d < 0 ? v.node->error : "");
  cv.notify_all();
  return true;
}

void Run::record_input(const ir::Value& v, const c10::Storage& bytes) {
  for (const auto& [w, s] : recording->inputs)
    if (w.node == v.node && w.index == v.index && s.unsafeGetStorageImpl() == bytes.unsafeGetStorageImpl()) return;
  recording->inputs.emplace_back(v, bytes);
}

void Run::order_on_stream(int lane, const std::vector<int>& producers, const std::vector<c10::Storage>& reads) {
  const Place& place = places[lane];
  std::vector<int> waited;
  for (int d : producers) {
    if (!events[d] || p.lane_of[d] == lane || std::find(waited.begin(), waited.end(), d) != waited.end()) continue;
    waited.push_back(d);
    if (recording) {
      Recording::Step wait;
      wait.kind = Recording::Step::Kind::Wait;
      wait.event = d;
      recording->lanes[lane].push_back(std::move(wait));
    }
    observers().before_event_wait();
    if (!observers().drops_event_wait()) events[d]->block(place.stream);
  }
  for (const auto& s : reads)
    if (!observers().drops_record_use()) record_use(s, place.stream);
}

} // namespace detail

using detail::Run;

ExecResult::ExecResult(ExecResult&& o) noexcept
    : values(std::exchange(o.values, {})),
      status(std::move(o.status)),
      timing(std::move(o.timing)),
      first_error(std::move(o.first_error)),
      first_message(std::move(o.first_message)),
      messages(std::move(o.messages)),
      makespan(o.makespan),
      remote_bytes_sent(o.remote_bytes_sent),
      remote_bytes_received(o.remote_bytes_received),
      remote_bytes_between_workers(o.remote_bytes_between_workers),
      started(o.started) {}

ExecResult& ExecResult::operator=(ExecResult&& o) noexcept {
  if (this != &o) {
    drop_values();
    values = std::exchange(o.values, {});
    status = std::move(o.status);
    timing = std::move(o.timing);
    first_error = std::move(o.first_error);
    first_message = std::move(o.first_message);
    messages = std::move(o.messages);
    makespan = o.makespan;
    remote_bytes_sent = o.remote_bytes_sent;
    remote_bytes_received = o.remote_bytes_received;
    remote_bytes_between_workers = o.remote_bytes_between_workers;
    started = o.started;
  }
  return *this;
}

ExecResult::~ExecResult() { drop_values(); }

void ExecResult::drop_values() {
  for (auto& vs : values)
    for (auto& s : vs) ir::release(s);
  values.clear();
}

namespace {
// PyTorch loads its CUDA linear algebra kernels on the first call of a
// factorization, and that first call fails when two threads make it at
// once ("lazy wrapper should be called at most once"): lanes of a run, or a
// background flight beside the program's own thread. Before a run on CUDA
// lanes that may make it, one call made here, once per process, loads them.
void load_cuda_linalg_before(const ir::Graph& g, const std::vector<Place>& places) {
  static std::once_flag loaded;
  static std::atomic<bool> done{false};
  if (done.load(std::memory_order_acquire)) return;
  const Place* cuda = nullptr;
  for (const auto& pl : places)
    if (!pl.remote && pl.device.is_cuda()) cuda = &pl;
  if (!cuda) return;
  bool wanted = false;
  for (const auto& n : g.nodes) wanted = wanted || may_load_cuda_linalg(n->name);
  if (!wanted) return;
  std::call_once(loaded, [&] {
    try {
      c10::OptionalDeviceGuard device(cuda->device);
      auto one = at::ones({1, 1}, at::TensorOptions().device(cuda->device));
      at::linalg_cholesky_ex(one);  // loading is on the host, in this call
    } catch (const std::exception&) {
      // A torch without those kernels: the op itself raises eager's error.
    }
    done.store(true, std::memory_order_release);
  });
}
} // namespace

// aten ops by name; any op of another namespace may (compiled partitions,
// custom ops call them inside).
bool may_load_cuda_linalg(std::string_view name) {
  if (name.rfind("aten::", 0) != 0) return name.find("::") != std::string_view::npos;
  name.remove_prefix(6);
  while (!name.empty() && name.front() == '_') name.remove_prefix(1);
  if (name.rfind("linalg_", 0) == 0) return true;
  // Whole words: "det" and "det_..." but not "detach".
  for (std::string_view p : {"cholesky", "lu", "triangular_solve", "orgqr", "ormqr", "geqrf", "svd", "eig", "inverse",
                             "lstsq", "det", "logdet", "slogdet", "ldl", "pinverse", "qr", "solve", "householder",
                             "symeig", "matrix_exp"})
    if (name.rfind(p, 0) == 0 && (name.size() == p.size() || name[p.size()] == '_' || name[p.size()] == '.'))
      return true;
  return false;
}

ExecResult execute(const ir::Graph& g, const plan::Plan& p, const std::vector<Place>& places, const Parts* parts,
                   Recording* recording) {
  ExecResult res;
  const size_t n = g.size();
  res.values.resize(n);
  res.status.assign(n, Status::NotRun);
  res.timing.resize(n);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    load_cuda_linalg_before(g, places);
    Run run(g, p, places, res);
    run.parts = parts;
    if (recording) {
      *recording = Recording();
      recording->places.assign(places.begin(), places.begin() + static_cast<std::ptrdiff_t>(p.lane_order.size()));
      recording->threads_per_lane = p.threads_per_lane;
      recording->lanes.resize(p.lane_order.size());
      for (size_t l = 0; l < p.lane_order.size(); ++l)
        if (!p.lane_order[l].empty() && !places[l].on_stream() && recording->unreplayable.empty())
          recording->unreplayable = "lane " + std::to_string(l) + " is not a stream lane";
      // Only stream lanes record; a run with another lane records nothing.
      if (recording->unreplayable.empty()) run.recording = recording;
    }
    res.started = run.t0;
    std::vector<int> busy;
    for (size_t l = 0; l < p.lane_order.size(); ++l) {
      if (p.lane_order[l].empty()) continue;
      if (places[l].is_remote()) {
        if (parts)
          for (int i : p.lane_order[l])
            TORCH_CHECK(parts->part_of[i] < 0, "mgpu: a part runs as one call on a lane of this process only");
        auto rl = std::make_unique<Run::RemoteLane>();
        rl->lane = static_cast<int>(l);
        rl->rem = places[l].remote;
        rl->steps = p.lane_order[l];
        rl->reported.assign(rl->steps.size(), 0);
        run.remote_lanes.push_back(std::move(rl));
      } else {
        busy.push_back(static_cast<int>(l));
      }
    }
    if (busy.size() <= 1 && run.remote_lanes.empty()) {
      // One lane: run on the calling thread, with the intra-op threads the
      // plan has for it (those of the thread that synced: a background
      // flight runs on another thread).
      for (int l : busy) {
        if (places[l].device.is_cpu() && p.threads_per_lane != thread_parallelism()) {
          ScopedParallelism threads(p.threads_per_lane);
          run.run_lane(l);
        } else {
          run.run_lane(l);
        }
      }
    } else {
      run.parallel = true;
      at::ThreadLocalState tls;  // grad mode, profiler, ... follow the work onto the lanes
      std::vector<std::function<void()>> jobs;
      for (int l : busy)
        jobs.emplace_back([&run, &tls, l] {
          at::ThreadLocalStateGuard guard(tls);
          run.run_lane(l);
        });
      // A remote lane: its program leaves now; one thread sends the
      // inputs other lanes make for it, one receives what it sends back.
      for (auto& rl : run.remote_lanes) {
        auto* lane = rl.get();
        run.send_program(*lane);
        if (!lane->later.empty())
          jobs.emplace_back([&run, &tls, lane] {
            at::ThreadLocalStateGuard guard(tls);
            run.send_inputs(*lane);
          });
        jobs.emplace_back([&run, &tls, lane] {
          at::ThreadLocalStateGuard guard(tls);
          run.receive_remote_lane(*lane);
        });
      }
      LanePool::instance().run(jobs, p.threads_per_lane);
    }
    run.finish_remote();
    res.remote_bytes_sent = run.sent_bytes.load();
    res.remote_bytes_received = run.received_bytes.load();
    res.remote_bytes_between_workers = run.peer_bytes.load();
    counters().remote_bytes_between_workers += res.remote_bytes_between_workers;
  } catch (const std::exception& e) {
    // The run could not start (a lane thread could not be made, memory ran
    // out): nothing that did not finish ran. Lanes are done here.
    const std::string msg = message_of(e);
    for (size_t i = 0; i < n; ++i) {
      if (res.status[i] != Status::NotRun) continue;
      res.status[i] = Status::Failed;
      if (!res.first_error) {
        res.first_error = std::current_exception();
        res.first_message = msg;
      }
    }
  }
  res.makespan = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (recording) {
    if (res.first_error && recording->unreplayable.empty()) recording->unreplayable = "a node failed";
    for (const auto& r : g.roots) {
      const int d = g.find(r.node.get());
      if (d >= 0 && static_cast<size_t>(r.index) < res.values[d].size() && res.values[d][r.index])
        recording->outputs.emplace_back(r, res.values[d][r.index]);
    }
  }
  if (observers().watches_streams()) {
    // The values left are the results: the host reads them from here on.
    std::vector<std::pair<const void*, std::string>> results;
    for (size_t i = 0; i < n; ++i)
      for (const auto& v : res.values[i])
        if (v) results.emplace_back(v.data(), "a result of node " + std::to_string(g.nodes[i]->id));
    observers().run_done(results);
  }
  return res;
}

} // namespace torch_mgpu::runtime

