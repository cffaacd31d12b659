// Replay of hot plans in the sync (replays.h): the registry of hot graphs
// on stream lanes, their recordings, and a replay's inputs and results.
#include "engine/replays.h"

#include "engine/tier1.h"
#include "ir/errors.h"
#include "ir/lru.h"
#include "ir/trial.h"
#include "runtime/replay.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_set>

namespace torch_mgpu::engine {

namespace {

constexpr size_t kTrialRuns = 3;  // timed runs of each way that decide

struct Entry {
  int hits = 0;
  std::string blocked;  // why it is never replayed
  std::shared_ptr<runtime::Recording> rec;
  std::vector<int> input_leaf;                   // per rec->inputs: its leaf's number (tier1::Numbering)
  // Per rec->inputs: the leaf whose value its bytes hold since the last
  // replay (none yet), and whether a step writes them (then copied every
  // time).
  std::vector<std::weak_ptr<ir::Node>> copied_from;
  std::vector<char> input_written;
  std::vector<std::pair<int, int>> output_at;    // per rec->outputs: (node, output) in the graph
  size_t leaves = 0;                             // the graph's leaves
  bool busy = false;                             // a run is replaying or recording it
  std::shared_ptr<runtime::Captured> captured;   // its CUDA graph, once captured
  std::string not_captured;                      // why it is not captured (known before, or its capture failed)
  // The trial of replay (way 1) against the run without it (way 0), once
  // recorded; `decided` once it chose (a rejection blocks the entry).
  ir::Trial times{2, kTrialRuns, ir::margin::kReplay};
  bool decided = false;
  std::string verdict;  // the trial's times, once decided
};

struct Replays {
  std::mutex m;
  ir::Lru<uint64_t, Entry> entries{256};
  ReplayPoolLimit limit;
};
Replays& registry() {
  static auto* r = new Replays();  // never destroyed: syncs may run at exit
  return *r;
}
std::atomic<int>& hits_needed() {
  static std::atomic<int> n{0};
  return n;
}
std::atomic<bool>& trial_on() {
  static std::atomic<bool> on{true};
  return on;
}
std::atomic<bool>& checks_on() {
  static std::atomic<bool> on{true};
  return on;
}

void forget(Entry& e) {
  e.times = ir::Trial(2, kTrialRuns, ir::margin::kReplay);
  e.decided = false;
  e.captured.reset();
  e.not_captured.clear();
  if (!e.rec) return;
  runtime::counters().replay_pool_bytes -= static_cast<int64_t>(e.rec->pool_bytes());
  runtime::counters().replay_recordings -= 1;
  e.rec.reset();
}

// Drops the least recently used recordings (not `keep`'s, not one in use)
// until those kept fit the limit. Under the lock.
void trim(Replays& r, const Entry* keep) {
  std::vector<Entry*> kept;  // most recently used first
  r.entries.for_each([&](const uint64_t&, Entry& e) {
    if (!e.busy && e.rec) kept.push_back(&e);
  });
  auto over = [&] {
    return runtime::counters().replay_pool_bytes.load() > static_cast<int64_t>(r.limit.bytes) ||
        runtime::counters().replay_recordings.load() > static_cast<int64_t>(r.limit.recordings);
  };
  for (auto it = kept.rbegin(); it != kept.rend() && over(); ++it) {
    Entry& e = **it;
    if (&e == keep) continue;
    forget(e);
    e.hits = 0;  // recorded again once hot again
    runtime::counters().replay_evicted += 1;
  }
}

// A copy of `s` in bytes of its own, on its device (queued on this
// thread's stream there: wait_for_copies).
c10::Storage copy_of(const c10::Storage& s) {
  c10::Storage out = runtime::allocate(s.nbytes(), s.device());
  if (s.nbytes()) runtime::byte_view(out, s.nbytes()).copy_(runtime::byte_view(s, s.nbytes()));
  return out;
}

// Copies queued on this thread's stream of `device` are done (a copy from
// pageable host memory may return before it lands; a device's copy is
// queued): lanes' streams and the host may read their bytes from here on.
void wait_for_copies(c10::Device device) {
  if (!device.is_cpu()) c10::impl::VirtualGuardImpl(device.type()).getStream(device).synchronize();
}

// The roots' bytes as tier 0 leaves them, from `bytes`, at `at` (each
// copied: the next replay writes the recording's bytes again). Throws
// before it changes `res`.
void bind_roots(runtime::ExecResult& res, const std::vector<std::pair<int, int>>& at,
                const std::vector<std::pair<ir::Value, c10::Storage>>& bytes) {
  std::vector<c10::Storage> copies;
  copies.reserve(at.size());
  for (size_t k = 0; k < at.size(); ++k) copies.push_back(copy_of(bytes[k].second));
  if (!copies.empty()) wait_for_copies(copies[0].device());
  for (size_t k = 0; k < at.size(); ++k) {
    const auto [i, j] = at[k];
    auto& slot = res.values[static_cast<size_t>(i)];
    if (slot.size() <= static_cast<size_t>(j)) slot.resize(static_cast<size_t>(j) + 1);
    if (slot[j]) ir::release(slot[j]);
    slot[j] = std::move(copies[k]);
    ir::hold(slot[j]);
  }
}

// Records the run of `g`: its result, with the entry set up for replays.
runtime::ExecResult record(const ir::Graph& g, const Lanes& l, const plan::Plan& p, Entry& e, ReplayRun& run) {
  auto rec = std::make_shared<runtime::Recording>();
  runtime::ExecResult res = runtime::execute(g, p, l.places, nullptr, rec.get());
  if (!rec->unreplayable.empty()) {
    // A node failed: the next hot run records again. Anything else is the
    // graph's for good.
    if (rec->unreplayable != "a node failed") e.blocked = rec->unreplayable;
    e.hits = 0;
    run.why = rec->unreplayable;
    return res;
  }
  const tier1::Numbering nb = tier1::number(g);
  std::vector<int> input_leaf;
  for (const auto& [v, bytes] : rec->inputs) {
    const int k = nb.of(v, -1);
    if (k < 0) {
      e.blocked = run.why = "an input that is not one of the graph's leaves";
      return res;
    }
    input_leaf.push_back(k);
  }
  std::vector<std::pair<int, int>> output_at;
  for (const auto& [v, bytes] : rec->outputs) output_at.emplace_back(g.find(v.node.get()), v.index);
  for (const auto& r : g.roots)
    if (g.find(r.node.get()) >= 0 &&
        std::find(output_at.begin(), output_at.end(), std::make_pair(g.find(r.node.get()), r.index)) == output_at.end()) {
      e.blocked = run.why = "a result the run did not keep";
      return res;
    }
  std::optional<std::string> no_capture;
  std::vector<char> input_written(rec->inputs.size(), 0);
  try {
    // The roots the sync binds get bytes of their own (copied before the
    // recording's inputs get theirs: an input written in place is a root
    // whose bytes are the leaf's until then).
    bind_roots(res, output_at, rec->outputs);
    rec->own_inputs();
    // Known before any capture: it replays step by step.
    if (capture_checks()) no_capture = runtime::capture_blocker(g, p, l.places);
    std::unordered_set<const c10::StorageImpl*> written;
    for (const auto& lane : rec->lanes)
      for (const auto& step : lane)
        for (const auto& w : step.writes)
          if (w) written.insert(w.unsafeGetStorageImpl());
    for (size_t k = 0; k < rec->inputs.size(); ++k)
      input_written[k] = written.count(rec->inputs[k].second.unsafeGetStorageImpl()) ? 1 : 0;
  } catch (const std::exception& ex) {
    // Memory ran out: the run's results stand as tier 0 left them (it has
    // written in place: it must be bound, not run again); no recording.
    e.hits = 0;
    run.why = "recording it failed: " + ir::message_of(ex);
    return res;
  }
  // The graph's nodes and the leaves' first bytes are not kept with it.
  for (auto& in : rec->inputs) in.first = ir::Value();
  for (auto& out : rec->outputs) out.first = ir::Value();
  for (const auto& lane : rec->lanes) run.steps += lane.size();
  e.rec = rec;
  if (no_capture) e.not_captured = *no_capture;
  e.times.baseline_warm();  // hot: it has run without replay before (forget() reset the trial)
  e.input_leaf = std::move(input_leaf);
  e.copied_from.assign(e.input_leaf.size(), {});
  e.input_written = std::move(input_written);
  e.output_at = std::move(output_at);
  e.leaves = nb.leaves.size();
  runtime::counters().replay_recordings += 1;
  runtime::counters().replay_pool_bytes += static_cast<int64_t>(rec->pool_bytes());
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    trim(r, &e);
  }
  run.recorded = true;
  return res;
}

// Copies the leaves of `g` into the recording's inputs; false where a leaf
// does not fit (its bytes are another size, it is not materialized). A
// leaf that is the very value copied at the last replay (a Data node's
// bytes never change), into bytes no step writes, is not copied again.
bool copy_inputs(const ir::Graph& g, Entry& e, ReplayRun& run) {
  const tier1::Numbering nb = tier1::number(g);
  if (nb.leaves.size() != e.leaves) return false;
  run.inputs = e.input_leaf.size();
  for (size_t k = 0; k < e.input_leaf.size(); ++k) {
    const ir::NodePtr& leaf_ptr = nb.leaves[static_cast<size_t>(e.input_leaf[k])].node;
    const ir::Node& leaf = *leaf_ptr;
    const c10::Storage& into = e.rec->inputs[k].second;
    if (leaf.kind == ir::NodeKind::Data && !e.input_written[k] && e.copied_from[k].lock() == leaf_ptr) continue;
    e.copied_from[k].reset();  // until this copy is done
    c10::Storage from;
    if (leaf.kind == ir::NodeKind::Empty) {
      // Uninitialized, yet one value: the bytes it already has somewhere,
      // or from now on those the replay reads.
      from = leaf.replica_or(into.device(), [&](const c10::Storage* any) {
        return any ? runtime::copy_to(*any, into.device(), /*wait=*/true) : copy_of(into);
      });
    } else if (leaf.kind == ir::NodeKind::Data) {
      from = leaf.data;
      if (from.device() != into.device())
        if (auto r = leaf.replica(into.device())) from = r;
    } else {
      return false;
    }
    if (from.nbytes() < into.nbytes()) return false;
    if (into.nbytes()) runtime::byte_view(into, into.nbytes()).copy_(runtime::byte_view(from, into.nbytes()));
    run.inputs_copied += 1;
    if (leaf.kind == ir::NodeKind::Data) e.copied_from[k] = leaf_ptr;
  }
  // The lanes' streams start after the copies.
  if (run.inputs_copied) wait_for_copies(e.rec->inputs[0].second.device());
  return true;
}

} // namespace

bool replay_trial() { return trial_on().load(); }
void set_replay_trial(bool on) { trial_on() = on; }
bool capture_checks() { return checks_on().load(); }
void set_capture_checks(bool on) { checks_on() = on; }

int replay_hits() { return hits_needed().load(std::memory_order_relaxed); }
void set_replay_hits(int hits) {
  TORCH_CHECK(hits >= 0, "replay hits must be 0 (off) or more, got ", hits);
  hits_needed() = hits;
}

ReplayPoolLimit replay_pool_limit() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  return r.limit;
}

void set_replay_pool_limit(ReplayPoolLimit limit) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  r.limit = limit;
  trim(r, nullptr);
}

void clear_replays() {
  if (runtime::in_forked_child()) return;  // its lock may have been held at the fork
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  std::vector<uint64_t> idle;  // a busy entry's run is under way: it stays
  r.entries.for_each([&](const uint64_t& k, Entry& e) {
    if (e.busy) return;
    forget(e);
    idle.push_back(k);
  });
  for (uint64_t k : idle) r.entries.erase(k);
}

std::optional<runtime::ExecResult> run_replay(const ir::Graph& g, const Lanes& l, const plan::Plan& p, ReplayRun& run) {
  const int need = replay_hits();
  if (need <= 0 || g.size() == 0 || l.places.empty() || !l.places[0].on_stream()) return std::nullopt;
  // A forked child runs plans on one lane and takes no lock of this registry
  // (another thread may have held it at the fork).
  if (runtime::in_forked_child()) return std::nullopt;
  // What a recorded call keeps and the structural hash does not see: the
  // constants' values, each node's grad mode and intra-op thread count, and
  // the lanes' thread count.
  uint64_t key = ir::hash_combine(tier1::key_of(g, l), tier1::fixed_hash(g, {}));
  key = ir::hash_combine(key, static_cast<uint64_t>(p.threads_per_lane));
  for (const auto& n : g.nodes)
    key = ir::hash_combine(key, (static_cast<uint64_t>(static_cast<uint16_t>(n->call_threads)) << 1) | n->grad_mode);
  auto& r = registry();
  Entry* e = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.m);
    e = &r.entries.get(key, [](const Entry& x) { return x.busy; }, [](const uint64_t&, Entry& x) { forget(x); });
    // A busy entry's fields are its run's until it is done.
    if (e->busy) return std::nullopt;
    if (!e->blocked.empty()) {
      run.why = e->blocked;
      return std::nullopt;
    }
    if (!e->rec && ++e->hits <= need) return std::nullopt;
    if (e->rec && !e->decided && replay_trial()) {
      // On trial: this run's way, in turns.
      run.key = key;
      run.way = static_cast<int>(e->times.turn());
      run.timed = e->times.call(static_cast<size_t>(run.way));
      if (run.way == 0) {
        run.note = "on trial against its run without replay";
        return std::nullopt;
      }
    } else if (e->decided) {
      run.note = e->verdict;
    }
    e->busy = true;  // kept in the registry (Lru's keep) until done
  }
  struct Done {
    Replays& r;
    Entry& e;
    ~Done() {
      std::lock_guard<std::mutex> lock(r.m);
      e.busy = false;
    }
  } done{r, *e};
  if (!e->rec) {
    if (auto why = runtime::replay_blocker(g, p, l.places)) {
      e->blocked = run.why = *why;
      return std::nullopt;
    }
    const ir::CallState plain;
    for (const auto& n : g.nodes)
      if (n->state != plain) {
        e->blocked = run.why = runtime::describe_node(*n) + " was called under non-default settings";
        return std::nullopt;
      }
    return record(g, l, p, *e, run);
  }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    if (!copy_inputs(g, *e, run)) {
      // Its leaves are not those it was recorded with: recorded again when hot.
      std::lock_guard<std::mutex> lock(r.m);
      forget(*e);
      e->hits = 0;
      return std::nullopt;
    }
    if (e->captured) {
      runtime::launch(*e->captured);
      run.captured = true;
    } else if (e->not_captured.empty() && runtime::can_capture(*e->rec)) {
      // This run's results, issued on the capture's streams as the capture
      // issues them; then the capture, in which nothing runs. Where it
      // fails, the steps are issued again instead from the next run on.
      std::string why_not;
      e->captured = runtime::capture(*e->rec, why_not);
      if (e->captured) {
        runtime::counters().replay_captures += 1;
        run.note = "captured as one CUDA graph for its next replays";
      } else {
        e->not_captured = why_not.empty() ? "its capture failed" : why_not;
      }
    } else {
      runtime::replay(*e->rec);
    }
    // Checks left to the end (a result that does not hold: run anew).
    runtime::raise_failed_checks(*e->rec);
  } catch (const std::exception& ex) {
    {
      std::lock_guard<std::mutex> lock(r.m);
      forget(*e);
      e->hits = 0;
    }
    // (It wrote only the recording's bytes: nothing to undo.)
    ir::rethrow_if_interrupt(ex);
    runtime::counters().replay_dropped += 1;
    run.why = "its replay failed: " + ir::message_of(ex);
    return std::nullopt;
  }
  runtime::ExecResult res;
  res.values.resize(g.size());
  res.status.assign(g.size(), runtime::Status::Ok);
  res.timing.resize(g.size());
  res.started = t0;
  bind_roots(res, e->output_at, e->rec->outputs);
  res.makespan = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& lane : e->rec->lanes) run.steps += lane.size();
  if (!e->not_captured.empty()) run.note = "not captured as a CUDA graph: " + e->not_captured;
  run.replayed = true;
  runtime::counters().replay_runs += 1;
  return res;
}

void observe_replay(const ReplayRun& run, double seconds) {
  if (run.way < 0 || !run.timed) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  Entry* e = r.entries.peek(run.key);
  if (!e || !e->rec || e->decided) return;  // dropped, recorded again, or decided since
  e->times.record(static_cast<size_t>(run.way), seconds);
  if (!e->times.all_timed()) return;
  const double with = e->times.median_of(1), without = e->times.median_of(0);
  auto ms = [](double s) { return std::to_string(s * 1e3).substr(0, 6) + " ms"; };
  const std::string times = "replayed " + ms(with) + ", without replay " + ms(without) + " (medians of " +
      std::to_string(kTrialRuns) + ")";
  if (e->times.choose() == 1) {
    e->decided = true;
    e->verdict = "kept after its trial: " + times;
    return;
  }
  runtime::counters().replay_rejected += 1;
  forget(*e);
  e->blocked = "slower than its run without replay in its trial: " + times;
}

} // namespace torch_mgpu::engine
