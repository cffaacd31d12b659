// The sync point. Reads as its phases: collect the live pending storages,
// build the graph, look up or build a plan, execute, bind the results back
// to the storages, then report the first error if an op raised.
#include "ir/env.h"
#include "capture/capture.h"
#include "engine/engine.h"
#include "engine/execution.h"
#include "engine/plan_cache.h"
#include "engine/replays.h"
#include "engine/report.h"
#include "engine/tiers.h"
#include "ir/call_state.h"
#include "runtime/place.h"
#include "runtime/counters.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <unordered_set>

namespace torch_mgpu {
namespace engine {
namespace {

std::vector<capture::LazyBuffer*> collect() {
  auto bufs = capture::pending_buffers();
  // Creation order, so that the same program builds the same graph (and
  // hash) every time, whatever the registry's iteration order.
  std::sort(bufs.begin(), bufs.end(), [](auto* a, auto* b) {
    if (a->value.node->id != b->value.node->id) return a->value.node->id < b->value.node->id;
    return a->value.index < b->value.index;
  });
  return bufs;
}

// The bytes a version of a storage holds.
size_t value_nbytes(const ir::Value& v) {
  const auto& n = *v.node;
  if (n.kind == ir::NodeKind::Data) return n.data.nbytes();
  return v.index < static_cast<int>(n.outputs.size()) ? n.outputs[v.index].nbytes : 0;
}

// Why node i of `g` did not produce its outputs: its own error, or that of
// the failed node it waited for.
std::string lost_because(int i, const ir::Graph& g, const runtime::ExecResult& res) {
  std::vector<int> todo{i};
  std::vector<char> seen(g.size(), 0);
  while (!todo.empty()) {
    const int k = todo.back();
    todo.pop_back();
    if (seen[k]) continue;
    seen[k] = 1;
    auto m = res.messages.find(k);
    if (m != res.messages.end()) return m->second;
    for (int d : g.deps[k])
      if (res.status[d] != runtime::Status::Ok) todo.push_back(d);
  }
  return res.first_message.empty() ? std::string("an earlier op failed") : res.first_message;
}

// The value a storage ends with when the node making it did not run: an
// in-place write that failed leaves the storage as it was before the op
// (when that earlier version survives and covers the storage); anything
// else becomes an error naming the op that failed.
ir::Value resolve(ir::Value v, const ir::Graph& g, const runtime::ExecResult& res) {
  while (true) {
    const int i = g.find(v.node.get());
    if (i < 0) return v;  // materialized before this sync
    if (res.status[i] == runtime::Status::Ok) {
      auto s = res.values[i][v.index];
      TORCH_INTERNAL_ASSERT(static_cast<bool>(s), "mgpu: a result was freed before binding");
      return ir::Value{ir::make_data(std::move(s)), 0};
    }
    // An in-place write that did not happen leaves the storage with its
    // previous version: its own bytes when the node wrote a copy, the same
    // bytes when it was to write in place (a node fails before it writes,
    // or, as in eager, part-way). Either way the write happened once or
    // not at all, and the storage stays readable. A write that was to grow
    // the storage (out= into a smaller tensor) leaves nothing readable at
    // the tensor's new size: its value is lost.
    const auto& out = v.node->outputs[v.index];
    if (out.mutated_operand >= 0 && value_nbytes(v.node->operands[out.mutated_operand]) >= out.nbytes) {
      v = v.node->operands[out.mutated_operand];
      continue;
    }
    return ir::Value{ir::make_error("mgpu: this tensor's value was lost when an op failed: " + lost_because(i, g, res),
                                    out.nbytes),
                     0};
  }
}


} // namespace

// Building and planning may throw: then nothing ran, and the nodes stay
// pending. Execution never throws (a node that fails fails alone), and once
// it has begun the results must be bound whatever happens after: an
// in-place write that ran must not run again.
void Execution::run() {
  auto t0 = clock::now();
  g = ir::build_graph(roots);
  auto t1 = clock::now();
  plan = plan_for(g, *lanes, caller_threads);
  runtime::counters().syncs++;
  auto t2 = clock::now();
  TierRun tier;
  ReplayRun replay;
  std::optional<runtime::ExecResult> compiled = run_replay(g, *lanes, *plan, replay);
  if (!compiled) compiled = run_tier1(g, *lanes, caller_threads, tier);
  if (compiled) {
    result = std::move(*compiled);
  } else {
    result = runtime::execute(g, *plan, lanes->places);
  }
  ran = true;
  auto t3 = clock::now();
  observe_replay(replay, std::chrono::duration<double>(t3 - t1).count());
  try {
    if (!replay.replayed)  // a replay is neither tier's run
      observe_tier(g, *lanes, tier, std::chrono::duration<double>(t3 - t2).count(),
                   static_cast<bool>(result.first_error));
    auto rec = engine::describe(g, *plan, &result);
    record = rec;
    rec->replay = replay.replayed ? std::string("replayed its recording") + (replay.captured ? " as one CUDA graph" : "") +
            " (" + std::to_string(replay.steps) + " steps, " + std::to_string(replay.inputs_copied) + " of " +
            std::to_string(replay.inputs) + " inputs copied)"
        : replay.recorded         ? "recorded for replay (" + std::to_string(replay.steps) + " steps)"
        : !replay.why.empty()     ? "not replayed: " + replay.why
                                  : "";
    if (!replay.note.empty()) rec->replay += (rec->replay.empty() ? "" : "; ") + replay.note;
    if (replay.replayed) {
      rec->tier = 2;
    } else if (tier.compiled) {
      rec->tier = 1;
      rec->compiled = tier.compiled->description + (tier.choice.empty() ? "" : "; kept after it " + tier.choice);
    } else {
      learn(g, *lanes, caller_threads, plan, result);
    }
  } catch (const std::exception&) {
    // What the plan did and learned is lost (memory ran out); the results
    // are not.
  }
  runtime::counters().sync_report_us += micros(t3, clock::now());
  runtime::counters().sync_graph_us += micros(t0, t1);
  runtime::counters().sync_plan_us += micros(t1, t2);
  runtime::counters().sync_execute_us += micros(t2, t3);
}

// Binds an execution's results: each root value becomes the Data (or Error)
// leaf it resolved to, in the live storages that hold it and in the nodes
// recorded since it started (a flight runs while capture goes on, and new
// nodes may read its roots). Under the state lock, with nothing running.
void bind(Execution& e) {
  auto t0 = clock::now();
  const ir::Graph& g = e.g;
  observe_executed(g, e.result);
  auto in_graph = [&](const ir::Value& v) { return g.find(v.node.get()) >= 0; };
  // (node, output) -> leaf, for every root
  std::map<std::pair<const ir::Node*, int>, ir::Value> leaf;
  for (const auto& r : g.roots)
    if (in_graph(r) && !leaf.count({r.node.get(), r.index}))
      leaf.emplace(std::make_pair(r.node.get(), r.index), resolve(r, g, e.result));
  auto leaf_of = [&](const ir::Value& v) -> ir::Value {
    auto it = leaf.find({v.node.get(), v.index});
    if (it != leaf.end()) return it->second;
    // Only roots can be read from outside the graph; anything else is a bug,
    // reported on read rather than by crashing.
    return ir::Value{ir::make_error("mgpu: a value computed in the background was not kept", v.node->outputs[v.index].nbytes), 0};
  };
  std::vector<ir::Node*> newer;  // pending nodes outside the graph
  std::unordered_set<const ir::Node*> seen;
  for (auto* b : capture::pending_buffers()) {
    if (in_graph(b->value)) b->value = leaf_of(b->value);
    else if (seen.insert(b->value.node.get()).second) newer.push_back(b->value.node.get());
  }
  // Nodes recorded since the execution started read its roots: point them
  // at the leaves. Walks only nodes outside the graph.
  while (!newer.empty()) {
    ir::Node* n = newer.back();
    newer.pop_back();
    for (auto& v : n->operands) {
      if (!v.node) continue;
      if (in_graph(v)) v = leaf_of(v);
      else if (v.node->is_pending() && seen.insert(v.node.get()).second) newer.push_back(v.node.get());
    }
  }
  set_last_plan(e.record);
  for (auto& n : g.nodes) ir::mark_executed(*n);
  runtime::counters().sync_bind_us += micros(t0, clock::now());
}

std::vector<ir::Value> pending_roots() {
  std::vector<ir::Value> roots;
  for (auto* b : collect()) roots.push_back(b->value);
  return roots;
}

namespace {
// Read by every capture, set from any thread: atomic.
std::atomic<int64_t>& max_pending_slot() {
  static std::atomic<int64_t> n{ir::env::integer(ir::env::Var::MaxPending, 100000)};
  return n;
}
} // namespace

int64_t max_pending_ops() { return max_pending_slot(); }
void set_max_pending_ops(int64_t n) {
  TORCH_CHECK(n > 0, "max_pending_ops must be positive, got ", n);
  max_pending_slot() = n;
}

void sync_all() {
  capture::StateLock lock;
  finish_flight();  // a flight binds first: the sync computes what is still pending
  engine::Execution e;
  e.roots = engine::pending_roots();
  if (!e.roots.empty()) {
    // The graph runs under the settings its ops were called with (one set
    // per graph: backend::record_call cuts the graph where they change).
    ir::CallStateGuard settings(e.roots.front().node->state);
    e.run();
    engine::bind(e);
  }
  std::exception_ptr error = engine::take_background_error();  // it happened first
  if (!error) error = e.result.first_error;
  if (error) std::rethrow_exception(error);
}

c10::Storage materialize(const c10::Storage& mgpu_storage) {
  capture::StateLock lock;
  auto* b = capture::buffer_of(mgpu_storage);
  if (b->value.node->is_pending()) sync_all();
  const auto& n = *b->value.node;
  switch (n.kind) {
    case ir::NodeKind::Data: {
      // Views of the storage read up to its size: never hand out fewer bytes.
      TORCH_CHECK(n.data.nbytes() >= mgpu_storage.nbytes(), "mgpu: a storage of ", mgpu_storage.nbytes(),
                  " bytes holds a value of ", n.data.nbytes(), " bytes (internal error)");
      if (n.data.device().is_cpu()) return n.data;
      // Computed on a device: the host gets a copy, and the storage keeps
      // both (lanes on that device read the device bytes with no transfer).
      c10::Storage host = runtime::copy_to(n.data, c10::Device(c10::kCPU));
      auto leaf = ir::make_data(host);
      leaf->add_replica(n.data);
      for (const auto& r : n.replicas())
        if (!r.device().is_cpu()) leaf->add_replica(r);
      b->value = ir::Value{leaf, 0};
      return host;
    }
    case ir::NodeKind::Empty: {
      // An uninitialized storage gets bytes for good: those a node already
      // read, if one did (the same storage must not read two ways).
      const size_t nbytes = std::max(n.outputs[0].nbytes, mgpu_storage.nbytes());
      c10::Storage host = n.replica_or(c10::Device(c10::kCPU), [&](const c10::Storage* any) {
        return any ? runtime::copy_to(*any, c10::Device(c10::kCPU)) : runtime::allocate(nbytes);
      });
      if (host.nbytes() < nbytes) {
        c10::Storage grown = runtime::allocate(nbytes);
        std::memcpy(grown.mutable_data(), host.data(), host.nbytes());
        host = grown;
      }
      b->value = ir::Value{ir::make_data(host), 0};
      return host;
    }
    case ir::NodeKind::Error:
      TORCH_CHECK(false, n.error);
    case ir::NodeKind::Op:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "mgpu: storage still pending after sync");
}

} // namespace engine
} // namespace torch_mgpu

