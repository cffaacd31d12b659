#pragma once
// One execution of a plan (runtime::execute): the state its lanes share
// (Run), and its steps by where they run: the run's own and its start
// (executor.cpp), lanes of this process, host threads or streams
// (run_lanes.cpp), and lanes of other ranks, each one program
// (remote_lanes.cpp). Inside runtime/ only.
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
#include "runtime/replay.h"
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
#include "ir/errors.h"
#include "runtime/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace torch_mgpu::runtime::detail {

// An error's message without the C++ backtrace (kept with values it lost).
using ir::message_of;

// Whether this thread's work is being recorded by torch.profiler (its
// per-thread profiler; the process-wide on-demand one takes no spans with
// times of their own).
inline bool profiling() {
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
inline void report_span(int64_t start_us, int64_t end_us, const std::string& name, const std::string& where) {
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
// An interrupt (ir::is_interrupt) stays as it is.
inline std::exception_ptr with_node_context(const ir::Node& n, std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (c10::Error& err) {
    err.add_context("mgpu: raised by " + describe_node(n) + " when the pending graph ran");
    return std::current_exception();
  } catch (const std::bad_alloc&) {
    return e;
  } catch (const std::exception& err) {
    if (ir::is_interrupt(err)) return e;
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
inline std::exception_ptr error_with(const std::string& msg) {
  try {
    TORCH_CHECK(false, msg);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// Part `part`'s call over `reads` at `place`, its accesses reported to the
// observers on a stream lane.
std::vector<c10::Storage> call_part(const Part& part, const std::vector<c10::Storage>& reads, const Place& place);

// Shared by the lanes of one execution. Guarded by `m`: statuses, values,
// reader counts, cross-device copies and Data replicas. Lanes wait on `cv`
// for inputs (the host order); stream lanes also wait on their inputs'
// events (the device order).
struct Run {
  const ir::Graph& g;
  const plan::Plan& p;
  const std::vector<Place>& places;
  ExecResult& res;
  const Parts* parts = nullptr;  // nodes that run as one call (executor.h)
  // What the stream lanes queue, for replay (replay.h); null when not
  // recording. A lane appends to its own steps; `inputs` under the lock.
  Recording* recording = nullptr;
  // Recording: leaf operand v, as lane `lane` read it (`bytes`). Under the lock.
  void record_input(const ir::Value& v, const c10::Storage& bytes);
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

  Run(const ir::Graph& graph, const plan::Plan& plan, const std::vector<Place>& pl, ExecResult& r);

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
  void fail(int i, Status s, std::exception_ptr e, const std::string& msg);
  uint64_t first_id = 0;  // the node whose error is res.first_error

  // Materialized bytes for a lane at `place`: a copy on its device, made
  // once and kept with the Data node.
  c10::Storage leaf(const ir::Node& n, const Place& place);

  // The bytes of operand value v for a node on `lane`; a value made on
  // another device is copied over (a transfer), once per device.
  c10::Storage operand(const ir::Value& v, int d, int lane, std::unique_lock<std::mutex>& lock);

  // Value v (made by node d; d < 0: a leaf) cannot be read: its producer
  // failed or was skipped, or the leaf is a value whose computation failed
  // earlier. Under the lock.
  bool missing(const ir::Value& v, int d) const {
    return d >= 0 ? res.status[d] != Status::Ok : v.node->kind == ir::NodeKind::Error;
  }
  // The error a reader of missing value v (made by d) is skipped with: the
  // leaf's own, or none (its producer's error is reported).
  static std::exception_ptr skipped_by(const ir::Value& v, int d) {
    return d < 0 ? error_with(v.node->error) : nullptr;
  }

  // Operand k of node i is missing: node i is skipped. Under the lock.
  bool skip_if_missing(int i, size_t k);

  // Waits (in a parallel run) until every producer of the nodes of `items`
  // (node_of(item): an item is a node's index, or a step naming one) that
  // `outside(d)` accepts has run. Under the lock.
  template <class Items, class Outside, class NodeOf>
  void wait_for_producers(std::unique_lock<std::mutex>& lock, const Items& items, Outside outside, NodeOf node_of) {
    if (!parallel) return;
    cv.wait(lock, [&] {
      for (const auto& item : items)
        for (int d : g.deps[node_of(item)])
          if (outside(d) && res.status[d] == Status::NotRun) return false;
      return true;
    });
  }

  // Before work on stream lane `lane`: its stream waits for the events of
  // `producers` run on other lanes (each once), and the allocator learns
  // that `reads` are used on it.
  void order_on_stream(int lane, const std::vector<int>& producers, const std::vector<c10::Storage>& reads);

  // What res.values holds for a value kept on a worker: its size, no bytes.
  static bool is_stand_in(const c10::Storage& s) { return s && s.device().type() == c10::kMeta; }

  // Node i of a remote lane ran there (its exported outputs in `got`, by
  // output index; the others stay there). Under the lock.
  void remote_done(int i, std::vector<std::pair<int, c10::Storage>> got);

  // Lane l's program: each node as data, each operand a slot of the
  // program (made by an earlier step, or an input) or a value the worker
  // keeps (a materialized leaf, sent once and kept from run to run).
  //
  // The program is sent in two parts: its structure (the same whenever
  // this plan runs this lane: the worker keeps it, by the structure's hash,
  // and later runs send only the hash) and what changes from run to run
  // (the ids of the kept values it reads, node ids, seeds, floating and
  // tensor constants).
  std::string build_program(RemoteLane& rl, std::vector<c10::Storage>& blobs);

  // In place of lane rl's program when it cannot be built, if it has
  // peers: a program of no steps that takes every value other workers
  // send it and tells those that read its values that they will not come
  // ("" when there is no such value). Under the lock.
  std::string stub_program(RemoteLane& rl);

  // The sending half of a remote lane: its program, then the inputs other
  // lanes make, each once its producer has run (or a word that it failed).
  // Sends lane rl's program (from the calling thread, before the lanes
  // start: the worker begins while they wake up).
  void send_program(RemoteLane& rl) noexcept;

  // The inputs of lane rl's program that other lanes make, each sent once
  // its producer has run (or a word that it failed).
  void send_inputs(RemoteLane& rl) noexcept;

  static std::string message_of_current();

  // The end of lane rl's program: every step's status and times, and the
  // results. Returns the spans of the steps that ran there, for the
  // profiler (empty when it is not recording).
  using Spans = std::vector<std::pair<std::pair<double, double>, std::string>>;
  Spans take_end(RemoteLane& rl, Reader& r, std::vector<c10::Storage>& blobs);

  // Spans of nodes that ran on another rank, on the profiler's clock.
  void report_remote(const RemoteLane& rl, const Spans& spans) const;

  // The receiving half: each step's exported outputs or error as it comes,
  // then every step's status and times. A rank that stops answering fails
  // the steps it had not reported, naming it.
  void receive_remote_lane(RemoteLane& rl) noexcept;

  // Results of node i (already Ok, its outputs kept there) that came back:
  // they replace their stand-ins. Under the lock.
  void attach(int i, std::vector<std::pair<int, c10::Storage>> got);

  // After the lanes: values made on workers and still held come back (the
  // results, and earlier versions that a failed in-place write leaves its
  // storage with); the workers drop the run's slots. A value that cannot
  // be fetched (its rank is lost) fails its node.
  void finish_remote();

  void run_one(int lane, int i);
  // Recording: node i ran on stream lane `lane`, reading `read` and making
  // `made` (reuse: the operands it could write in place).
  void record_call(int lane, int i, std::vector<c10::Storage> read, const std::vector<c10::Storage>& made,
                   const std::vector<bool>& reuse);
  // Records node i's event on lane `lane`'s stream (and in the recording).
  void record_event(int lane, int i);

  // Frees each graph value node i was the last to read. Under the lock.
  void release_operands(int i);

  // Runs a fused group (plan/fusion.h) as one pass on a CPU lane. When an
  // input is missing (an op before it failed) its steps run one by one, so
  // that each reports as an unfused node would.
  void run_group(int lane, const plan::FusedGroup& grp);

  // Runs part `part` (executor.h) as one call on `lane`.
  void run_part(int lane, const Part& part);

  // Node i failed outside its own try (a wait, a lock, an allocation of the
  // executor's): it fails alone, so that no lane waits for it forever.
  void fail_unexpected(int i, std::exception_ptr e);

  // Runs lane l's nodes in order: a stream lane with its stream current,
  // done when its stream has finished them. Never throws: every failure is
  // some node's error (or, for the stream's last synchronize, the run's).
  // After lane l's stream finished: each node's end is the device's time
  // of its timing event; it started when it was queued or when the node
  // before it on the stream ended, whichever was later. A backend whose
  // events carry no time keeps the host's times.
  void device_times(int l, const c10::Event& start, double start_s);

  // Lane l of this process, by its kind (place.h): a host lane's nodes (and
  // fused groups) in order; a stream lane's queued on its stream, which is
  // then synchronized (a device error fails the run). Remote lanes run as
  // programs (remote_lanes.cpp).
  void run_lane(int l) noexcept;
  void run_host_lane(int l);
  void run_stream_lane(int l);
  // Lane l's nodes in plan order: compiled parts as one call, fused groups
  // (`fuse`) as one pass, the others one by one.
  void run_in_order(int l, bool fuse);
};

} // namespace torch_mgpu::runtime::detail
