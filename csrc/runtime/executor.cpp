#include "runtime/executor.h"
#include "ir/errors.h"
#include "ir/held_bytes.h"

#include <ATen/ops/linalg_cholesky_ex.h>
#include <ATen/ops/ones.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/version.h>

#include "runtime/observer.h"
#include "runtime/faults.h"
#include "runtime/host_cache.h"
#include "runtime/counters.h"
#include "runtime/lanes.h"
#include "runtime/pointwise.h"
#include "runtime/remote.h"
#include "runtime/serialize.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace torch_mgpu::runtime {

namespace {

// An error's message without the C++ backtrace (kept with values it lost).
using ir::message_of;

// Whether this thread's work is being recorded by torch.profiler (its
// per-thread profiler; the process-wide on-demand one takes no spans with
// times of their own).
bool profiling() {
  using torch::profiler::impl::ProfilerStateBase;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
  const bool on_demand = ProfilerStateBase::getGlobal() != nullptr;
#else
  const bool on_demand = ProfilerStateBase::get(/*global=*/true) != nullptr;
#endif
  return !on_demand && torch::profiler::impl::profilerEnabled() &&
         torch::profiler::impl::profilerType() == torch::profiler::impl::ActiveProfilerType::KINETO;
}

// A span on the profiler's clock for work done elsewhere (a node that ran on
// another rank, with the times it measured there): it shows on the thread
// that reports it, the one standing for that rank's lane.
void report_span(int64_t start_us, int64_t end_us, const std::string& name, const std::string& where) {
  torch::autograd::profiler::reportBackendEventToActiveKinetoProfiler(start_us, std::max(end_us, start_us), -1,
                                                                    at::RecordScope::FUNCTION, name, where);
}

// A span around a transfer of bytes between ranks while it lives:
// "mgpu::send_to_rank1" and the like, with the byte count as its input
// (shown in the trace with record_shapes). None for no bytes.
class TransferSpan {
 public:
  TransferSpan(const char* what, int rank, size_t nbytes) {
    if (!nbytes) return;
    span_.emplace(at::RecordScope::FUNCTION);
    if (!span_->isActive()) return;
    const std::vector<c10::IValue> inputs{c10::IValue(static_cast<int64_t>(nbytes))};
    span_->before(std::string("mgpu::") + what + "_rank" + std::to_string(rank), &inputs);
  }

 private:
  std::optional<at::RecordFunction> span_;
};

// Error `e` of node `n`, with the node named in its message (a c10::Error
// keeps its Python class: IndexError stays an IndexError).
std::exception_ptr with_node_context(const ir::Node& n, std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (c10::Error& err) {
    err.add_context("mgpu: raised by " + describe_node(n) + " when the pending graph ran");
    return std::current_exception();
  } catch (const std::bad_alloc&) {
    return e;
  } catch (const std::exception& err) {
    // A kernel's plain std::runtime_error ("value cannot be converted ...
    // without overflow"): Python shows both as RuntimeError.
    c10::Error named{std::string(err.what())};
    named.add_context("mgpu: raised by " + describe_node(n) + " when the pending graph ran");
    return std::make_exception_ptr(named);
  } catch (...) {
    return e;
  }
}

// A c10::Error carrying `msg`, as an exception_ptr.
std::exception_ptr error_with(const std::string& msg) {
  try {
    TORCH_CHECK(false, msg);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// Shared by the lanes of one execution. Guarded by `m`: statuses, values,
// reader counts, cross-device copies and Data replicas. Lanes wait on `cv`
// for inputs (the host order); stream lanes also wait on their inputs'
// events (the device order).
struct Run {
  const ir::Graph& g;
  const plan::Plan& p;
  const std::vector<Place>& places;
  ExecResult& res;
  // Flat per-node arrays (one allocation each, not one per node):
  // producer[operand_at[i] + k]: the node making operand k of node i, -1
  // outside the graph; readers / is_root[output_at[i] + j]: for output j.
  std::vector<int> operand_at, output_at;
  std::vector<int> producer;
  std::vector<int> readers;
  std::vector<char> is_root;
  // A value copied to another device, once per device: (node, output, device).
  // On stream lanes `ready` is recorded on the copying lane's stream after
  // the copy; other lanes of that device wait for it.
  struct Copy {
    c10::Storage bytes;
    std::shared_ptr<c10::Event> ready;
    int lane = 0;
    bool done = false;  // false while the copying lane is at it
  };
  std::map<std::tuple<int, int, int>, Copy> copies;
  // Stream lanes: an event after each node read on another lane.
  std::vector<std::optional<c10::Event>> events;
  // Stream lanes: a timing event after each node, so that its end time is
  // when the device finished it, not when the host queued it.
  std::vector<std::optional<c10::Event>> ends;
  std::mutex m;
  std::condition_variable cv;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  bool parallel = false;
  // Lanes of other ranks (remote.h): each runs as one program per run.
  // Per output of a node run there, its slot in that program, and whether
  // it comes back: 1 as soon as it is made (another lane reads it), 2 with
  // the program's end (a result), 0 not (res.values holds a stand-in of
  // its size, no bytes; the worker frees it after its last use).
  std::vector<int64_t> remote_slot;
  std::vector<char> exported;
  // Per output of a node run on a worker: the other workers whose lanes
  // read it, to which it goes straight (not through this process).
  std::vector<std::vector<int>> forward;
  struct RemoteLane {
    int lane = 0;
    std::shared_ptr<Remote> rem;
    std::vector<int> steps;     // nodes, in the lane's order
    std::vector<char> reported; // per step: its status is set
    size_t cursor = 0;          // steps before it are reported
    // Inputs made on other lanes, in the order the steps need them.
    struct Later {
      int64_t slot;
      ir::Value v;
      int producer;  // -1: a leaf
    };
    std::vector<Later> later;
    bool sent = false, send_failed = false;
    bool stub_sent = false;  // a program of no steps went in its place (see send_program)
    std::vector<int64_t> fresh;  // kept values this program sends first
    double sent_at = 0;  // when the program left (its steps' times count from here)
  };
  std::vector<std::unique_ptr<RemoteLane>> remote_lanes;
  std::atomic<int64_t> sent_bytes{0}, received_bytes{0}, peer_bytes{0};

  ~Run() {
    for (const auto& c : copies) ir::release(c.second.bytes);
  }
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  Run(const ir::Graph& graph, const plan::Plan& plan, const std::vector<Place>& pl, ExecResult& r)
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
        if (from.streams && p.lane_of[d] != p.lane_of[i] && !events[d]) events[d].emplace(from.device.type());
      }
    }
    for (const auto& r2 : g.roots) {
      const int d = g.find(r2.node.get());
      if (d >= 0) is_root[output_at[d] + r2.index] = 1;
    }
    bool remote = false;
    for (size_t l = 0; l < p.lanes.size(); ++l) remote |= static_cast<bool>(places[l].remote);
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

  double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
  // The rank lane l runs on (0: this process).
  int rank_of(int l) const { return places[l].remote ? places[l].remote->rank() : 0; }
  // Whether output `out` goes straight to worker `rank` (decided once per run).
  bool forwarded_to(int out, int rank) const {
    return rank && std::find(forward[out].begin(), forward[out].end(), rank) != forward[out].end();
  }

  // Node i failed (its own work: Failed) or could not run (an input was
  // lost: Skipped, with the lost value's error when it came from outside
  // the graph). A node's own error names it.
  void fail(int i, Status s, std::exception_ptr e, const std::string& msg) {
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
  uint64_t first_id = 0;  // the node whose error is res.first_error

  // Materialized bytes for a lane at `place`: a copy on its device, made
  // once and kept with the Data node.
  c10::Storage leaf(const ir::Node& n, const Place& place) {
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
    if (place.streams)
      observers().stream_access(place.device, "the copy of data node " + std::to_string(n.id) + " to " + place.device.str(),
                                {n.data.data()}, {moved.data()}, /*synchronous=*/true);
    observers().transferred(moved.nbytes());
    n.add_replica(moved);
    return moved;
  }

  // The bytes of operand value v for a node on `lane`; a value made on
  // another device is copied over (a transfer), once per device.
  c10::Storage operand(const ir::Value& v, int d, int lane, std::unique_lock<std::mutex>& lock) {
    const Place& place = places[lane];
    if (d < 0) return leaf(*v.node, place);
    const int src_lane = p.lane_of[d];
    const int device = p.lanes[lane].device;
    c10::Storage src = res.values[d][v.index];
    if (p.lanes[src_lane].device == device) return src;
    // Sent back by another rank's lane: already a copy in host memory.
    if (places[src_lane].remote && src.device() == place.device) return src;
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
      if (places[src_lane].streams) on_producer.emplace(places[src_lane].stream);
      observers().before_transfer();
      moved.bytes = copy_to(src, place.device);
      if (places[src_lane].streams) {
        observers().stream_access(places[src_lane].device,
                                  "the copy of node " + std::to_string(g.nodes[d]->id) + "'s value to " +
                                      place.device.str(),
                                  {src.data()}, {moved.bytes.data()}, /*synchronous=*/false);
        // The copy is queued on the producer's stream: this lane's stream
        // waits for it through an event of ours (ATen's device-to-device
        // copy also orders it with the destination's current stream, both
        // ways; the way back, the copy after the destination block's own
        // stream, is still ATen's).
        if (place.streams) {
          c10::Event copied(places[src_lane].device.type());
          copied.record(places[src_lane].stream);
          copied.block(place.stream);
        }
      }
      on_producer.reset();
      if (place.streams) {
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

  // Operand k of node i is missing (an op before it failed, or it reads a
  // value whose computation failed earlier): node i is skipped. Under the lock.
  bool skip_if_missing(int i, size_t k) {
    const ir::Value& v = g.nodes[i]->operands[k];
    const int d = producer[operand_at[i] + k];
    const bool missing = d >= 0 ? res.status[d] != Status::Ok : v.node->kind == ir::NodeKind::Error;
    if (!missing) return false;
    std::exception_ptr e;
    std::string msg;
    if (d < 0) {
      msg = v.node->error;
      e = error_with(msg);
    }
    fail(i, Status::Skipped, e, msg);
    cv.notify_all();
    return true;
  }

  // What res.values holds for a value kept on a worker: its size, no bytes.
  static bool is_stand_in(const c10::Storage& s) { return s && s.device().type() == c10::kMeta; }

  // Node i of a remote lane ran there (its exported outputs in `got`, by
  // output index; the others stay there). Under the lock.
  void remote_done(int i, std::vector<std::pair<int, c10::Storage>> got) {
    const ir::Node& node = *g.nodes[i];
    std::vector<c10::Storage> out;
    for (const auto& o : node.outputs) out.push_back(placeholder(o.nbytes));
    for (auto& [k, bytes] : got) {
      // (A storage may hold more than the value: a kernel's result can be
      // a view of a larger buffer, a written operand is its whole storage.)
      TORCH_CHECK(k >= 0 && k < static_cast<int>(out.size()) && bytes.nbytes() >= node.outputs[k].nbytes,
                  "torch_mgpu: a worker sent back a value of the wrong size");
      out[k] = std::move(bytes);
    }
    for (const auto& o : out) ir::hold(o);
    res.values[i] = std::move(out);
    res.status[i] = Status::Ok;
    for (size_t k = 0; k < node.outputs.size(); ++k)  // what it sent other workers
      peer_bytes += static_cast<int64_t>(node.outputs[k].nbytes * forward[output_at[i] + k].size());
    release_operands(i);
  }

  // Lane l's program: each node as data, each operand a slot of the
  // program (made by an earlier step, or an input) or a value the worker
  // keeps (a materialized leaf, sent once and kept from run to run).
  //
  // The program is sent in two parts: its structure (the same whenever
  // this plan runs this lane: the worker keeps it, by the structure's hash,
  // and later runs send only the hash) and what changes from run to run
  // (the ids of the kept values it reads, node ids, seeds, floating and
  // tensor constants).
  std::string build_program(RemoteLane& rl, std::vector<c10::Storage>& blobs) {
    const int l = rl.lane;
    Remote& rem = *rl.rem;
    fault_point(FaultPoint::Program, rem.name());
    ProgramMessage m;
    int64_t slots = 0;
    std::map<std::pair<const void*, int>, int64_t> input_slot;
    std::map<const void*, int64_t> resident_param;
    std::vector<std::pair<int64_t, size_t>> allocs;
    Writer peers;   // inputs other workers send: slot, rank, key
    uint32_t npeers = 0;
    Writer steps;   // the structure's steps
    Writer values;  // the run's values, per step
    steps.put<uint32_t>(static_cast<uint32_t>(rl.steps.size()));
    for (int i : rl.steps) {
      const ir::Node& node = *g.nodes[i];
      write_node(steps, values, node);
      steps.put<uint32_t>(static_cast<uint32_t>(node.operands.size()));
      for (size_t k = 0; k < node.operands.size(); ++k) {
        const ir::Value& v = node.operands[k];
        const int d = producer[operand_at[i] + k];
        int64_t ref;
        if (d >= 0 && p.lane_of[d] == l) {
          ref = remote_slot[output_at[d] + v.index];
        } else if (d < 0 && v.node->kind == ir::NodeKind::Data) {
          auto [it, first] = resident_param.try_emplace(v.node.get(), static_cast<int64_t>(m.reads.size()));
          if (first) {
            bool fresh = false;
            const int64_t id = rem.resident(v.node, fresh, m.drop);
            if (fresh) {
              m.keep.push_back(id);
              blobs.push_back(leaf(*v.node, Place()));  // its bytes in host memory
              rl.fresh.push_back(id);
            }
            m.reads.push_back(id);
          }
          ref = -1 - it->second;
        } else if (d >= 0 && forwarded_to(output_at[d] + v.index, rank_of(l))) {
          // Made on another worker, which sends it here (keyed by its
          // output's index in the graph).
          auto [it, first] = input_slot.try_emplace({g.nodes[d].get(), v.index}, slots);
          if (first) {
            peers.put<int64_t>(slots++);
            peers.put<int32_t>(rank_of(p.lane_of[d]));
            peers.put<int64_t>(output_at[d] + v.index);
            ++npeers;
          }
          ref = it->second;
        } else {
          const void* key = d >= 0 ? static_cast<const void*>(g.nodes[d].get()) : static_cast<const void*>(v.node.get());
          auto [it, first] = input_slot.try_emplace({key, v.index}, slots);
          if (first) {
            // Uninitialized bytes are allocated there, not sent.
            if (d < 0 && v.node->kind == ir::NodeKind::Empty) allocs.emplace_back(slots++, v.node->outputs[0].nbytes);
            else rl.later.push_back({slots++, v, d});
          }
          ref = it->second;
        }
        steps.put<int64_t>(ref);
        steps.put<uint8_t>(p.reuse[i][k] && ref >= 0);  // a kept value is never written in place
      }
      steps.put<uint32_t>(static_cast<uint32_t>(node.outputs.size()));
      for (size_t k = 0; k < node.outputs.size(); ++k) {
        const int out = output_at[i] + k;
        remote_slot[out] = slots;
        steps.put<int64_t>(slots++);
        steps.put<uint8_t>(exported[out]);
        steps.put<uint32_t>(static_cast<uint32_t>(forward[out].size()));
        for (int to : forward[out]) steps.put<int32_t>(to);
        if (!forward[out].empty()) steps.put<int64_t>(out);
      }
    }
    Writer structure;
    put_structure_head(structure, places[l].there, static_cast<uint32_t>(slots), allocs, npeers, peers.bytes(), 0, "");
    structure.bytes() += steps.bytes();
    m.structure = std::move(structure.bytes());
    m.key = std::hash<std::string>{}(m.structure);
    m.known = rem.knows_program(m.key, m.forget);
    counters().remote_programs++;
    if (!m.known) counters().remote_structures_sent++;
    m.values = std::move(values.bytes());
    return m.bytes();
  }

  // In place of lane rl's program when it cannot be built, if it has
  // peers: a program of no steps that takes every value other workers
  // send it and tells those that read its values that they will not come
  // ("" when there is no such value). Under the lock.
  std::string stub_program(RemoteLane& rl) {
    Writer peers, missing;
    uint32_t npeers = 0, nmissing = 0;
    std::set<std::pair<int, int>> seen;
    for (int i : rl.steps) {
      const ir::Node& node = *g.nodes[i];
      for (size_t k = 0; k < node.operands.size(); ++k) {
        const int d = producer[operand_at[i] + k];
        if (d < 0 || !forwarded_to(output_at[d] + node.operands[k].index, rank_of(rl.lane))) continue;
        if (!seen.insert({d, node.operands[k].index}).second) continue;
        peers.put<int64_t>(npeers++);
        peers.put<int32_t>(rank_of(p.lane_of[d]));
        peers.put<int64_t>(output_at[d] + node.operands[k].index);
      }
      for (size_t k = 0; k < node.outputs.size(); ++k)
        for (int to : forward[output_at[i] + k]) {
          missing.put<int32_t>(to);
          missing.put<int64_t>(output_at[i] + k);
          ++nmissing;
        }
    }
    if (!npeers && !nmissing) return "";
    // On the worker's CPU, a slot per value it takes, no steps.
    Writer structure;
    put_structure_head(structure, c10::Device(c10::kCPU), npeers, {}, npeers, peers.bytes(), nmissing, missing.bytes());
    structure.put<uint32_t>(0);
    ProgramMessage m;
    m.structure = std::move(structure.bytes());
    m.key = std::hash<std::string>{}(m.structure);
    m.known = rl.rem->knows_program(m.key, m.forget);
    return m.bytes();
  }

  // The sending half of a remote lane: its program, then the inputs other
  // lanes make, each once its producer has run (or a word that it failed).
  // Sends lane rl's program (from the calling thread, before the lanes
  // start: the worker begins while they wake up).
  void send_program(RemoteLane& rl) noexcept {
    std::string program;
    try {
      std::vector<c10::Storage> blobs;
      {
        std::lock_guard<std::mutex> lock(m);
        program = build_program(rl, blobs);
      }
      for (const auto& b : blobs) {
        observers().transferred(b.nbytes());
        sent_bytes += static_cast<int64_t>(b.nbytes());
      }
      {
        std::lock_guard<std::mutex> lock(m);
        rl.sent_at = now();
      }
      size_t nbytes = program.size();
      for (const auto& b : blobs) nbytes += b.nbytes();
      TransferSpan span("program_to", rl.rem->rank(), nbytes);
      rl.rem->send(Msg::Exec, program, blobs);
    } catch (const std::exception&) {
      // Not built (a node that cannot be sent): the values it would have
      // sent first are not there, and other workers that read its values,
      // or send it theirs, hear so from a program of no steps. Not sent:
      // the rank is lost.
      if (program.empty()) {
        rl.rem->unregister(rl.fresh);
        try {
          std::string stub;
          {
            std::lock_guard<std::mutex> lock(m);
            stub = stub_program(rl);
          }
          if (!stub.empty()) {
            rl.rem->send(Msg::Exec, stub, {});
            rl.stub_sent = true;
          }
        } catch (const std::exception&) {
          // The rank is lost: its peers see it gone.
        }
      } else {
        rl.rem->forget_residents();
      }
      std::lock_guard<std::mutex> lock(m);
      rl.send_failed = true;
      for (size_t s = 0; s < rl.steps.size(); ++s)
        if (!rl.reported[s] && res.status[rl.steps[s]] == Status::NotRun) {
          rl.reported[s] = 1;
          observers().node_failed();
          fail(rl.steps[s], Status::Failed, std::current_exception(), message_of_current());
        }
      rl.sent = true;
      cv.notify_all();
      return;
    }
    std::lock_guard<std::mutex> lock(m);
    rl.sent = true;
  }

  // The inputs of lane rl's program that other lanes make, each sent once
  // its producer has run (or a word that it failed).
  void send_inputs(RemoteLane& rl) noexcept {
    if (rl.send_failed) return;
    for (const auto& in : rl.later) {
      c10::Storage bytes;
      std::string why;
      {
        std::unique_lock<std::mutex> lock(m);
        if (in.producer >= 0) cv.wait(lock, [&] { return res.status[in.producer] != Status::NotRun; });
        try {
          if (in.producer < 0) {
            if (in.v.node->kind == ir::NodeKind::Error) why = in.v.node->error;
            else bytes = leaf(*in.v.node, Place());
          } else if (res.status[in.producer] == Status::Ok) {
            bytes = res.values[in.producer][in.v.index];
            if (!bytes.device().is_cpu()) {
              // Queued after its producer on that lane's stream (its status
              // is set once the kernel is queued), and waited for.
              const Place& from = places[p.lane_of[in.producer]];
              std::optional<c10::StreamGuard> after;
              if (from.streams) after.emplace(from.stream);
              bytes = copy_to(bytes, c10::Device(c10::kCPU), /*wait=*/true);
            }
          } else {
            why = "lost";
          }
        } catch (const std::exception& e) {
          why = message_of(e);
          bytes = c10::Storage();
        }
      }
      Writer w;
      w.put<int64_t>(in.slot);
      try {
        if (bytes) {
          observers().before_transfer();
          TransferSpan span("send_to", rl.rem->rank(), bytes.nbytes());
          rl.rem->send(Msg::Import, w.bytes(), {bytes});
          observers().transferred(bytes.nbytes());
          sent_bytes += static_cast<int64_t>(bytes.nbytes());
        } else {
          rl.rem->send(Msg::Missing, w.bytes(), {});
        }
      } catch (const std::exception&) {
        return;  // the receiving half sees the rank fail
      }
    }
  }

  static std::string message_of_current() {
    try {
      throw;
    } catch (const std::exception& e) {
      return message_of(e);
    } catch (...) {
      return "unknown error";
    }
  }

  // The end of lane rl's program: every step's status and times, and the
  // results. Returns the spans of the steps that ran there, for the
  // profiler (empty when it is not recording).
  using Spans = std::vector<std::pair<std::pair<double, double>, std::string>>;
  Spans take_end(RemoteLane& rl, Reader& r, std::vector<c10::Storage>& blobs) {
    Spans spans;
    size_t nbytes = 0;
    for (const auto& b : blobs) nbytes += b.nbytes();
    TransferSpan span("receive_from", rl.rem->rank(), nbytes);
    std::lock_guard<std::mutex> lock(m);
    std::vector<uint8_t> status(rl.steps.size());
    std::vector<std::pair<double, double>> times(rl.steps.size());
    for (size_t s = 0; s < rl.steps.size(); ++s) {
      status[s] = r.get<uint8_t>();
      times[s].first = r.get<double>();
      times[s].second = r.get<double>();
    }
    // The results, each with its step and output.
    std::map<uint32_t, std::vector<std::pair<int, c10::Storage>>> results;
    for (auto& b : blobs) {
      const auto s = r.get<uint32_t>();
      const auto k = r.get<uint32_t>();
      observers().transferred(b.nbytes());
      received_bytes += static_cast<int64_t>(b.nbytes());
      results[s].emplace_back(static_cast<int>(k), std::move(b));
    }
    const bool traced = profiling();
    for (size_t s = 0; s < rl.steps.size(); ++s) {
      const int i = rl.steps[s];
      res.timing[i] = NodeTiming{rl.lane, rl.sent_at + times[s].first, rl.sent_at + times[s].second, 1};
      if (traced && status[s] == 1)
        spans.emplace_back(std::make_pair(res.timing[i].start, res.timing[i].end), std::string(g.nodes[i]->name));
      auto got = results.find(static_cast<uint32_t>(s));
      if (rl.reported[s]) {
        // Reported before (it ran and kept its outputs there, or
        // exported some): its results replace their stand-ins.
        if (got != results.end() && res.status[i] == Status::Ok) attach(i, std::move(got->second));
        continue;
      }
      if (status[s] == 1) remote_done(i, got == results.end() ? decltype(got->second)() : std::move(got->second));
      else fail(i, Status::Skipped, nullptr, "");
      rl.reported[s] = 1;
    }
    cv.notify_all();
    return spans;
  }

  // Spans of nodes that ran on another rank, on the profiler's clock.
  void report_remote(const RemoteLane& rl, const Spans& spans) const {
    if (spans.empty()) return;
    const double origin_us = static_cast<double>(c10::getTime()) / 1e3 - now() * 1e6;  // this run's start
    const std::string where = "rank" + std::to_string(rl.rem->rank());
    for (const auto& [t, name] : spans)
      report_span(static_cast<int64_t>(origin_us + t.first * 1e6), static_cast<int64_t>(origin_us + t.second * 1e6),
                  "mgpu::" + name, where);
  }

  // The receiving half: each step's exported outputs or error as it comes,
  // then every step's status and times. A rank that stops answering fails
  // the steps it had not reported, naming it.
  void receive_remote_lane(RemoteLane& rl) noexcept {
    {
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return rl.sent; });
      if (rl.send_failed && !rl.stub_sent) return;
    }
    if (rl.send_failed) {
      // The program of no steps sent in its place ends as any other.
      try {
        Msg kind{};
        rl.rem->receive(kind, nullptr);
        TORCH_CHECK(kind == Msg::End, "torch_mgpu: rank ", rl.rem->rank(), " answered a program of no steps with ",
                    "message kind ", static_cast<uint32_t>(kind));
      } catch (const std::exception& e) {
        rl.rem->poison(message_of(e));
      }
      return;
    }
    try {
      while (true) {
        Msg kind{};
        std::vector<c10::Storage> blobs;
        std::string body = rl.rem->receive(kind, &blobs);
        Reader r(body);
        if (kind == Msg::End) {
          report_remote(rl, take_end(rl, r, blobs));
          return;
        }
        const auto s = r.get<uint32_t>();
        TORCH_CHECK(s < rl.steps.size(), "torch_mgpu: rank ", rl.rem->rank(), " reported step ", s, " of ",
                    rl.steps.size());
        const int i = rl.steps[s];
        std::lock_guard<std::mutex> lock(m);
        // Steps before it that reported nothing ran (a failed or skipped
        // step says so at once) and keep their outputs there.
        for (; rl.cursor < s; ++rl.cursor)
          if (!rl.reported[rl.cursor]) {
            remote_done(rl.steps[rl.cursor], {});
            rl.reported[rl.cursor] = 1;
          }
        if (kind == Msg::Skipped) {
          fail(i, Status::Skipped, nullptr, "");
        } else if (kind == Msg::Export) {
          size_t nbytes = 0;
          for (const auto& b : blobs) nbytes += b.nbytes();
          TransferSpan span("receive_from", rl.rem->rank(), nbytes);
          std::vector<std::pair<int, c10::Storage>> got;
          for (auto& b : blobs) {
            observers().transferred(b.nbytes());
            received_bytes += static_cast<int64_t>(b.nbytes());
            got.emplace_back(static_cast<int>(r.get<uint32_t>()), std::move(b));
          }
          remote_done(i, std::move(got));
        } else {
          TORCH_CHECK(kind == Msg::Failed, "torch_mgpu: rank ", rl.rem->rank(), " sent message kind ",
                      static_cast<uint32_t>(kind), " during a run");
          std::string msg;
          auto e = read_error(r, &msg);
          observers().node_failed();
          fail(i, Status::Failed, e, msg);
        }
        rl.reported[s] = 1;
        cv.notify_all();
      }
    } catch (const std::exception& e) {
      // A message that could not be taken leaves the connection out of step
      // (a late answer would be read by the next run): the rank is lost.
      rl.rem->poison(message_of(e));
      std::lock_guard<std::mutex> lock(m);
      for (size_t s = 0; s < rl.steps.size(); ++s)
        if (res.status[rl.steps[s]] == Status::NotRun) {
          rl.reported[s] = 1;
          observers().node_failed();
          fail(rl.steps[s], Status::Failed, std::current_exception(), message_of_current());
        }
      cv.notify_all();
    }
  }

  // Results of node i (already Ok, its outputs kept there) that came back:
  // they replace their stand-ins. Under the lock.
  void attach(int i, std::vector<std::pair<int, c10::Storage>> got) {
    auto& vals = res.values[i];
    for (auto& [k, bytes] : got) {
      TORCH_CHECK(k >= 0 && k < static_cast<int>(vals.size()) && bytes.nbytes() >= g.nodes[i]->outputs[k].nbytes,
                  "torch_mgpu: a worker sent back a value of the wrong size");
      if (!is_stand_in(vals[k])) continue;
      ir::release(vals[k]);
      vals[k] = std::move(bytes);
      ir::hold(vals[k]);
    }
  }

  // After the lanes: values made on workers and still held come back (the
  // results, and earlier versions that a failed in-place write leaves its
  // storage with); the workers drop the run's slots. A value that cannot
  // be fetched (its rank is lost) fails its node.
  void finish_remote() {
    // With no failure only the results matter, and they came back with
    // each program's end: the rest was freed there.
    const bool failed = static_cast<bool>(res.first_error);
    for (const auto& rl : remote_lanes) {
      for (int i : rl->steps) {
        auto& vals = res.values[i];
        for (size_t k = 0; k < vals.size(); ++k) {
          if (!is_stand_in(vals[k])) continue;
          c10::Storage got;
          if (failed && res.status[i] == Status::Ok) {
            try {
              observers().before_transfer();
              TransferSpan span("fetch_from", rl->rem->rank(), vals[k].nbytes());
              got = rl->rem->get(remote_slot[output_at[i] + k], vals[k].nbytes());
              observers().transferred(got.nbytes());
              received_bytes += static_cast<int64_t>(got.nbytes());
            } catch (const std::exception& e) {
              // A value the worker freed after its last use (its readers
              // ran before the failure) is needed by nothing; one on a lost
              // rank is lost with it.
              if (rl->rem->lost()) {
                observers().node_failed();
                fail(i, Status::Failed, std::current_exception(), message_of(e));
              }
            }
          }
          ir::release(vals[k]);
          vals[k] = got;
          if (got) ir::hold(got);
        }
        if (res.status[i] != Status::Ok)
          for (auto& v : vals) {
            if (v) ir::release(v);
            v = c10::Storage();
          }
      }
      if (!failed) continue;
      try {
        rl->rem->free({});  // the slots it kept for these reads
      } catch (const std::exception&) {
        // A lost rank keeps nothing.
      }
    }
  }

  void run_one(int lane, int i) {
    const ir::Node& node = *g.nodes[i];
    const Place& place = places[lane];
    std::unique_lock<std::mutex> lock(m);
    if (parallel) {
      cv.wait(lock, [&] {
        for (int d : g.deps[i])
          if (res.status[d] == Status::NotRun) return false;
        return true;
      });
    }
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
      if (place.streams) {
        for (int d : g.deps[i])
          if (events[d] && p.lane_of[d] != lane) {
            observers().before_event_wait();
            if (!observers().drops_event_wait()) events[d]->block(place.stream);
          }
        for (const auto& s : operands)
          if (!observers().drops_record_use()) record_use(s, place.stream);
      }
      observers().before_node(node);
      out = run_node(node, std::move(operands), *reuse, place);
      if (events[i]) events[i]->record(place.stream);
      if (place.streams) {
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

  // Frees each graph value node i was the last to read. Under the lock.
  void release_operands(int i) {
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

  // Runs a fused group (plan/fusion.h) as one pass on a CPU lane. When an
  // input is missing (an op before it failed) its steps run one by one, so
  // that each reports as an unfused node would.
  void run_group(int lane, const plan::FusedGroup& grp) {
    const Place& place = places[lane];
    const int id = p.fusion.group_of[grp.steps[0].node];
    auto outside = [&](int d) { return p.fusion.group_of[d] != id; };
    auto one_by_one = [&] {
      for (const auto& s : grp.steps) run_one(lane, s.node);
    };
    std::unique_lock<std::mutex> lock(m);
    if (parallel) {
      cv.wait(lock, [&] {
        for (const auto& s : grp.steps)
          for (int d : g.deps[s.node])
            if (outside(d) && res.status[d] == Status::NotRun) return false;
        return true;
      });
    }
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
      bool missing = d >= 0 ? res.status[d] != Status::Ok : v.node->kind == ir::NodeKind::Error;
      c10::Storage bytes;
      if (!missing) {
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
      }
      if (missing) {
        lock.unlock();
        held.clear();
        one_by_one();
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

  // Node i failed outside its own try (a wait, a lock, an allocation of the
  // executor's): it fails alone, so that no lane waits for it forever.
  void fail_unexpected(int i, std::exception_ptr e) {
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

  // Runs lane l's nodes in order: a stream lane with its stream current,
  // done when its stream has finished them. Never throws: every failure is
  // some node's error (or, for the stream's last synchronize, the run's).
  // After lane l's stream finished: each node's end is the device's time
  // of its timing event; it started when it was queued or when the node
  // before it on the stream ended, whichever was later. A backend whose
  // events carry no time keeps the host's times.
  void device_times(int l, const c10::Event& start, double start_s) {
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

  void run_lane(int l) noexcept {
    try {
      run_lane_nodes(l);
    } catch (...) {
      // Setting the lane up failed (its stream guard on a device in error):
      // its nodes fail.
      for (int i : p.lane_order[l]) fail_unexpected(i, std::current_exception());
    }
  }

  void run_lane_nodes(int l) {
    const Place& place = places[l];
    HostCacheScope host_memory;  // kernels' large outputs reuse freed blocks
    std::optional<c10::StreamGuard> guard;
    if (place.streams) guard.emplace(place.stream);
    const auto& order = p.lane_order[l];
    // Stream lanes: the device's clock for this lane's nodes starts here.
    std::optional<c10::Event> lane_start;
    double lane_start_s = 0;
    if (place.streams && !order.empty()) {
      lane_start.emplace(place.device.type(), c10::EventFlag::BACKEND_DEFAULT);
      lane_start->record(place.stream);
      lane_start_s = now();
    }
    const auto& f = p.fusion;
    const bool fuse = !f.group_at.empty() && !place.streams && !place.remote;  // host kernels over host memory
    for (size_t k = 0; k < order.size(); ++k) {
      const int grp = fuse ? f.group_at[order[k]] : -1;
      const size_t steps = grp < 0 ? 1 : f.groups[grp].steps.size();  // a group's steps are the lane's next nodes
      try {
        if (grp < 0) run_one(l, order[k]);
        else run_group(l, f.groups[grp]);
      } catch (...) {
        for (size_t s = 0; s < steps; ++s) fail_unexpected(order[k + s], std::current_exception());
      }
      k += steps - 1;
    }
    if (!place.streams || order.empty()) return;
    try {
      observers().before_stream_sync();
      place.stream.synchronize();
      observers().lane_done();
      device_times(l, *lane_start, lane_start_s);
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
};

} // namespace

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

ExecResult execute(const ir::Graph& g, const plan::Plan& p, const std::vector<Place>& places) {
  ExecResult res;
  const size_t n = g.size();
  res.values.resize(n);
  res.status.assign(n, Status::NotRun);
  res.timing.resize(n);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    load_cuda_linalg_before(g, places);
    Run run(g, p, places, res);
    res.started = run.t0;
    std::vector<int> busy;
    for (size_t l = 0; l < p.lane_order.size(); ++l) {
      if (p.lane_order[l].empty()) continue;
      if (places[l].remote) {
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
