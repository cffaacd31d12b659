// Tiered execution (see tiers.h): hot graphs, the compile queue, tier-1 runs
// and the measured choice between the tiers.
#include "engine/tiers.h"
#include "engine/tier1.h"
#include "ir/lru.h"
#include "ir/trial.h"
#include "ir/env.h"
#include "ir/fork_order.h"

#include "capture/lazy_tensor.h"
#include "capture/state_lock.h"
#include "ir/errors.h"
#include "engine/plan_cache.h"
#include "ir/call_state.h"
#include "ir/held_bytes.h"
#include "ir/partition.h"
#include "runtime/counters.h"
#include "runtime/lanes.h"
#include "runtime/observer.h"
#include "runtime/place.h"

#include <ATen/ThreadLocalState.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <pthread.h>
#include <unordered_map>
#include <unordered_set>

namespace torch_mgpu::engine {

using namespace tier1;

namespace {

constexpr size_t kTrialRuns = 3;       // timed tier-1 runs (after an untimed first) that decide
constexpr size_t kTier0Runs = 5;    // tier-0 times kept to compare with
// Runs a trial takes at most: a way whose constants compiled in never
// match the graph's (each way lifts its own) gets no times; the trial then
// decides over the ways that have them.
constexpr int kMaxTrialRuns = 24;
constexpr size_t kMaxEntries = 256; // graphs remembered; the least recently used goes
// Kept code whose recent runs (the median of this many) take this many
// times its trial's median goes through a second trial, in turns with tier
// 0: the machine may have got busier, or the graph's inputs larger, since
// the code was kept.
constexpr size_t kRecentRuns = 8;
constexpr double kSlowdown = 2.0;

enum class State { Cold, Queued, Trial, Kept, Rejected };

struct Entry {
  int hits = 0;
  State state = State::Cold;
  std::shared_ptr<const CompileRequest> request;  // while queued or compiling
  std::vector<uint64_t> first_values;  // each constant's exact hash at the first tier-0 run
  std::shared_ptr<const CompiledGraph> compiled;  // the code kept
  // On trial: the ways compiled (the whole graph; its parts on the lanes),
  // each's calls (the first is cold) and timed seconds.
  std::vector<std::shared_ptr<const CompiledGraph>> trial;
  // Way 0 tier 0 (its latest kTier0Runs seconds, kept before a trial
  // too), way j + 1 trial[j]; kept by ir::margin::kCompiled.
  ir::Trial times{1, kTrialRuns, ir::margin::kCompiled};
  int trial_runs = 0;          // runs since the trial began, in either tier
  std::vector<double> recent;  // kept code's latest runs
  double kept_median = 0;      // its trial's median
  std::string choice;          // what the trial measured: each way compiled, and tier 0
};

struct Tiers {
  std::mutex m;
  std::condition_variable cv;
  ir::Lru<uint64_t, Entry> entries{kMaxEntries};
  std::deque<std::shared_ptr<const CompileRequest>> queue;
  int compiling = 0;
  bool stopped = false;
  bool compiler = false;  // a compile thread serves the queue
  std::string last_error;  // why the last graph was dropped from tier 1
};

Tiers* g_tiers = nullptr;

Tiers& tiers() {
  static const bool made = [] {
    g_tiers = new Tiers();  // leaked: the compile thread may wait on it at exit
    // A forked child has no compile thread: its queue and its graphs start
    // empty, its mutex free. The parent's compiled code is left as it is
    // (not destroyed: that would take the GIL in the child).
    ir::on_fork(ir::ForkRank::Tiers, [] { g_tiers->m.lock(); }, [] { g_tiers->m.unlock(); }, [] {
      new (&g_tiers->m) std::mutex();
      new (&g_tiers->cv) std::condition_variable();
      new (&g_tiers->entries) ir::Lru<uint64_t, Entry>(kMaxEntries);
      g_tiers->queue.clear();
      g_tiers->compiling = 0;
      g_tiers->compiler = false;
    });
    return true;
  }();
  (void)made;
  return *g_tiers;
}

// Whether compiled code is on trial (else kept as soon as it is compiled).
std::atomic<bool>& trial_slot() {
  static std::atomic<bool> on{true};
  return on;
}

std::atomic<int>& hits_slot() {
  static std::atomic<int> n{[] {
    const auto e = ir::env::text(ir::env::Var::Compile);
    if (!e || e->empty() || *e == "on") return kDefaultCompileHits;  // on by default
    if (*e == "off") return 0;
    return static_cast<int>(ir::env::integer(ir::env::Var::Compile, kDefaultCompileHits));
  }()};
  return n;
}

// Runs of graphs not settled in tier 1 (queued, compiling or on trial): see unsettled_runs().
std::atomic<uint64_t>& unsettled_slot() {
  static std::atomic<uint64_t> n{0};
  return n;
}

// The entry of `key`, made if new (the least recently used one goes when
// there are kMaxEntries). Under t.m: the compiled code of an entry that
// goes is handed to `dropped`, to be let go of after t.m (its deleter takes
// the GIL, and a fork holds the GIL while it takes t.m).
Entry& entry_for(Tiers& t, uint64_t key, std::vector<std::shared_ptr<const CompiledGraph>>& dropped) {
  return t.entries.get(
      key, [](const Entry& e) { return e.state == State::Queued; },
      [&](uint64_t, Entry& e) {
        if (e.compiled) dropped.push_back(std::move(e.compiled));
        for (auto& c : e.trial) dropped.push_back(std::move(c));
      });
}

} // namespace

int compile_hits() { return hits_slot().load(); }
uint64_t unsettled_runs() { return unsettled_slot().load(std::memory_order_relaxed); }
void set_compile_trial(bool on) { trial_slot() = on; }
bool compile_trial() { return trial_slot(); }
void set_compile_hits(int hits) {
  TORCH_CHECK(hits >= 0, "compile hits must be >= 0 (0: off), got ", hits);
  hits_slot() = hits;
}

std::shared_ptr<const CompileRequest> next_compile_request() {
  auto& t = tiers();
  std::unique_lock<std::mutex> lock(t.m);
  t.cv.wait(lock, [&] { return t.stopped || !t.queue.empty(); });
  if (t.stopped) return nullptr;
  auto req = t.queue.front();
  t.queue.pop_front();
  t.compiling++;
  return req;
}

namespace {
// Where each compiled part of `req` runs and what it reads and returns, as
// the whole graph numbers them; false when the compiler returned another
// number of parts than the request has.
bool lay_out(const CompileRequest& req, CompiledGraph& c) {
  // The whole graph (one part) or the request's parts.
  const bool whole = c.parts.size() == 1;
  const size_t want = whole ? 1 : req.parts.size();
  if (c.parts.size() != want) return false;
  c.layout.assign(want, {});
  c.lifted.clear();
  std::unordered_map<int, int> made_by;  // value number -> the part returning it
  for (size_t p = 0; p < want; ++p) {
    const CompileRequest& part = whole ? req : req.parts[p];
    auto& lay = c.layout[p];
    lay.lane = part.lane;
    lay.nodes = part.whole_nodes;
    lay.leaves = part.whole_leaves;
    lay.roots = part.whole_roots;
    for (int w : lay.roots) made_by[w] = static_cast<int>(p);
    for (const auto& [i, k] : c.parts[p].lifted) {
      if (i < 0 || static_cast<size_t>(i) >= part.whole_nodes.size()) return false;
      lay.lifted.emplace_back(part.whole_nodes[static_cast<size_t>(i)], k);
      c.lifted.push_back(lay.lifted.back());
    }
    if (c.parts[p].input_dtypes.size() != lay.leaves.size()) return false;
  }
  // The parts each part reads from (earlier ones: join_along_lanes).
  for (auto& lay : c.layout)
    for (int w : lay.leaves) {
      auto it = made_by.find(w);
      if (it != made_by.end() && std::find(lay.after.begin(), lay.after.end(), it->second) == lay.after.end())
        lay.after.push_back(it->second);
    }
  c.lanes = std::max(1, req.lanes);
  c.device = req.device;
  c.streams = req.streams;
  return true;
}
} // namespace

void install_compiled(uint64_t key, std::vector<std::shared_ptr<CompiledGraph>> ways) {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.compiling = std::max(0, t.compiling - 1);
  auto& c = runtime::counters();
  c.tier1_compiled++;
  for (const auto& w : ways) c.tier1_compile_us += static_cast<int64_t>(w->compile_s * 1e6);
  Entry* found = t.entries.peek(key);
  if (found && found->state == State::Queued && found->request) {
    Entry& e = *found;
    // A way whose parts do not match the request's is dropped (the others
    // may still run).
    std::vector<std::shared_ptr<CompiledGraph>> fit;
    for (auto& w : ways)
      if (lay_out(*e.request, *w)) {
        w->fixed = fixed_hash(*e.request, w->lifted);
        fit.push_back(std::move(w));
      }
    ways = std::move(fit);
    if (ways.empty()) {
      e.state = State::Rejected;
      e.request.reset();
      t.last_error = "not compiled: the compiler returned parts that do not match the graph's";
      c.tier1_rejected++;
      t.cv.notify_all();
      return;
    }
    e.request.reset();
    if (trial_slot()) {
      e.state = State::Trial;
      e.trial_runs = 0;
      e.trial.assign(ways.begin(), ways.end());
      e.times = ir::Trial(1, kTrialRuns, ir::margin::kCompiled);  // tier 0 measured again in turns with them
      e.times.baseline_warm();
      for (size_t j = 0; j < ways.size(); ++j) e.times.add();
    } else {  // kept as compiled: the last way (the parts, where split)
      e.state = State::Kept;
      e.compiled = ways.back();
    }
  }
  t.cv.notify_all();
}

void reject_compiled(uint64_t key, const std::string& why) {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.compiling = std::max(0, t.compiling - 1);
  runtime::counters().tier1_rejected++;
  if (Entry* e = t.entries.peek(key)) {
    e->state = State::Rejected;
    e->request.reset();
  }
  t.last_error = "not compiled: " + why;
  t.cv.notify_all();
}

void stop_compiles() {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.stopped = true;
  t.compiler = false;
  t.queue.clear();
  t.cv.notify_all();
}

bool wait_for_compiles(double seconds) {
  auto& t = tiers();
  std::unique_lock<std::mutex> lock(t.m);
  return t.cv.wait_for(lock, std::chrono::duration<double>(seconds),
                       [&] { return t.queue.empty() && t.compiling == 0; });
}

std::string last_tier_error() {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  return t.last_error;
}

void set_compiler_present(bool present) {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.compiler = present;
  if (present) t.stopped = false;
}

namespace {
// Whether code compiled for some lanes may run on `l` (the same device and
// kind of lane, and every part's lane there).
bool fits(const CompiledGraph& c, const Lanes& l) {
  if (l.places.empty() || c.device != l.places[0].device.str() || c.streams != l.places[0].on_stream()) return false;
  for (const auto& lay : c.layout)
    if (lay.lane < 0 || static_cast<size_t>(lay.lane) >= l.places.size()) return false;
  return true;
}
} // namespace

std::optional<runtime::ExecResult> run_tier1(const ir::Graph& g, const Lanes& l, int caller_threads, TierRun& run) {
  if (compile_hits() == 0) return std::nullopt;
  run.key = key_of(g, l);
  std::shared_ptr<const CompiledGraph> compiled;
  std::vector<std::shared_ptr<const CompiledGraph>> ways;  // on trial
  ir::Trial times;
  {
    auto& t = tiers();
    std::lock_guard<std::mutex> lock(t.m);
    Entry* found = t.entries.find(run.key);  // a use
    if (!found || !(found->state == State::Trial || found->state == State::Kept)) return std::nullopt;
    Entry& e = *found;
    if (e.state == State::Kept) {
      compiled = e.compiled;
      run.choice = e.choice;
    } else {
      ways = e.trial;
      times = e.times;
    }
  }
  // The same structure on other lanes: tier 0. On trial, the ways and tier
  // 0 take turns (the machine's load, and tier 0's refined plan, then
  // weigh on all alike): the way called least so far among those whose
  // constants compiled in have this graph's values (each way lifts its
  // own), or tier 0 where it has fewer timed runs than that way (its
  // first call, cold, is not timed).
  if (!eligible(g, l)) return std::nullopt;
  if (!ways.empty()) {
    const size_t k = times.turn([&](size_t j) {
      const CompiledGraph& w = *ways[j - 1];
      return fits(w, l) && fixed_hash(g, w.lifted) == w.fixed;
    });
    if (k == 0) return std::nullopt;  // tier 0's turn, or no way's constants match
    compiled = ways[k - 1];
  }
  // Other values of the constants compiled in, or other lanes: tier 0.
  if (!compiled || !fits(*compiled, l) || fixed_hash(g, compiled->lifted) != compiled->fixed) return std::nullopt;
  try {
    // The compiled loops have their threads; the kernels they call (a
    // product) take this thread's, as they would on the syncing thread. A
    // split graph's lanes share the cores as tier 0's lanes do.
    runtime::ExecResult r;
    if (compiled->parts.size() == 1) {
      const int threads = std::clamp(caller_threads, 1, l.topo.cores);
      std::optional<runtime::ScopedParallelism> same;
      if (threads != runtime::thread_parallelism()) same.emplace(threads);
      r = call(g, *compiled, l, threads);
    } else {
      r = call(g, *compiled, l, l.topo.threads_per_lane(compiled->lanes));
    }
    run.compiled = std::move(compiled);
    runtime::counters().tier1_runs++;
    return r;
  } catch (const std::exception& e) {
    // A SIGINT taken by Python code in the compiled run (its wrapper runs on
    // this thread) stops the sync: nothing was written, the nodes stay
    // pending, and the code, not at fault, stays.
    ir::rethrow_if_interrupt(e);
    run.failed = true;
    // Nothing was written: tier 0 runs the graph and raises what it raises.
    // The compiled code is let go of after the lock (its deleter takes the
    // GIL, and a fork holds the GIL while it takes t.m).
    std::vector<std::shared_ptr<const CompiledGraph>> dropped{std::move(compiled)};
    auto& t = tiers();
    std::lock_guard<std::mutex> lock(t.m);
    t.last_error = std::string("a compiled run failed: ") + e.what();
    runtime::counters().tier1_fallbacks++;
    if (Entry* found = t.entries.peek(run.key)) {
      Entry& en = *found;
      const auto at = std::find(en.trial.begin(), en.trial.end(), dropped.front());
      if (en.state == State::Trial && at != en.trial.end() && en.trial.size() > 1) {
        // On trial beside another way: only this way goes.
        const auto j = static_cast<size_t>(at - en.trial.begin());
        dropped.push_back(std::move(en.trial[j]));
        en.trial.erase(en.trial.begin() + static_cast<std::ptrdiff_t>(j));
        en.times.drop(j + 1);
      } else {
        en.state = State::Rejected;
        dropped.push_back(std::move(en.compiled));
        for (auto& c : en.trial) dropped.push_back(std::move(c));
        en.trial.clear();
      }
    }
    return std::nullopt;
  }
}

// Ends a trial once every way and tier 0 have their timed runs: the
// fastest way is kept if it beats tier 0, else the graph stays in tier 0.
// A trial that ran kMaxTrialRuns times (its runs in either tier, counted by
// observe_tier) is decided over the ways that were timed.
void finish_trial(Tiers& t, Entry& e, std::vector<std::shared_ptr<const CompiledGraph>>& dropped) {
  const bool out_of_runs = e.trial_runs >= kMaxTrialRuns;
  std::vector<size_t> timed;  // the ways with their timed runs (their trial ways)
  for (size_t j = 1; j < e.times.size(); ++j) {
    if (e.times.timed(j)) timed.push_back(j);
    else if (!out_of_runs) return;
  }
  const bool tier0_timed = e.times.timed(0);
  if (!tier0_timed && !out_of_runs) return;
  if (timed.empty() || !tier0_timed) {
    e.state = State::Rejected;
    if (e.compiled) dropped.push_back(std::move(e.compiled));
    t.last_error = "compiled code could not be timed in its trial (constants compiled in that never matched the graph's)";
    runtime::counters().tier1_rejected++;
    for (auto& c : e.trial) dropped.push_back(std::move(c));
    e.trial.clear();
    return;
  }
  // Every way timed (or those that could be): the fastest against tier 0.
  const size_t chosen = e.times.choose(timed);
  const bool faster = chosen != 0;
  const size_t best = faster ? chosen : e.times.fastest(timed);
  const double best_s = e.times.median_of(best), tier0_s = e.times.median_of(0);
  e.state = faster ? State::Kept : State::Rejected;
  e.kept_median = best_s;
  if (faster) {
    e.compiled = e.trial[best - 1];
  } else {
    if (e.compiled) dropped.push_back(std::move(e.compiled));
    t.last_error = "compiled code ran no faster than tier 0 (" + std::to_string(best_s * 1e6) + " us, tier 0 " +
        std::to_string(tier0_s * 1e6) + " us)";
    runtime::counters().tier1_rejected++;
  }
  std::string times;
  for (size_t j : timed)
    times += std::string(e.trial[j - 1]->parts.size() == 1 ? "whole " : "parts ") +
        std::to_string(e.times.median_of(j) * 1e6) + " us, ";
  e.choice = "measured " + times + "tier 0 " + std::to_string(tier0_s * 1e6) + " us";
  for (auto& c : e.trial) dropped.push_back(std::move(c));
  e.trial.clear();
}

void observe_tier(const ir::Graph& g, const Lanes& l, const TierRun& run, double seconds, bool failed) {
  const int hits = compile_hits();
  if (hits == 0) return;
  auto& t = tiers();
  const uint64_t key = run.key ? run.key : key_of(g, l);
  std::vector<std::shared_ptr<const CompiledGraph>> dropped;  // let go of after the lock
  std::unique_lock<std::mutex> lock(t.m);
  // Whether tier 1 is still deciding about the graph once this run is
  // counted: about to be queued, queued or compiling, or on trial.
  struct Settle {
    Tiers& t;
    uint64_t key;
    std::unique_lock<std::mutex>& lock;
    ~Settle() {
      if (!lock.owns_lock()) return;
      const Entry* e = t.entries.peek(key);
      if (e && (e->state == State::Queued || e->state == State::Trial || (e->state == State::Cold && t.compiler)))
        unsettled_slot().fetch_add(1, std::memory_order_relaxed);
    }
  } settle{t, key, lock};
  Entry& e = entry_for(t, key, dropped);
  if (run.compiled && e.state == State::Kept) {
    if (!trial_slot()) return;  // kept without trials: kept as it is
    e.recent.push_back(seconds);
    if (e.recent.size() > kRecentRuns) e.recent.erase(e.recent.begin());
    if (e.kept_median == 0 && e.recent.size() == kRecentRuns) {
      e.kept_median = median(e.recent);  // kept before trials were on: its first runs are the measure
      e.recent.clear();
      return;
    }
    const double now = e.recent.size() == kRecentRuns ? median(e.recent) : 0;
    if (now > kSlowdown * e.kept_median) {
      t.last_error = "compiled code slowed down (" + std::to_string(now * 1e6) + " us, " +
          std::to_string(e.kept_median * 1e6) + " us in its trial): a second trial, in turns with tier 0";
      // Tier 0's runs of before are no measure now: the two take turns
      // again, from the compiled code's next (warm, timed) run.
      e.state = State::Trial;
      e.trial_runs = 0;
      e.choice.clear();
      e.trial = {e.compiled};
      e.times = ir::Trial(1, kTrialRuns, ir::margin::kCompiled);
      e.times.baseline_warm();
      e.times.add(/*warm=*/true);  // no untimed run
      e.recent.clear();
    }
    return;
  }
  if (run.compiled) {
    if (e.state != State::Trial) return;
    const size_t k = static_cast<size_t>(std::find(e.trial.begin(), e.trial.end(), run.compiled) - e.trial.begin());
    if (k == e.trial.size()) return;
    if (e.times.call(k + 1)) e.times.record(k + 1, seconds);  // the first call is cold
    ++e.trial_runs;
    finish_trial(t, e, dropped);
    return;
  }
  if (failed || run.failed) return;  // an error is no measure of the graph (nor a failed compiled call's time)
  if (e.state == State::Rejected || e.state == State::Kept) return;
  // The trial compares runs on the lanes its code was compiled for (the
  // key has the lanes: a run on others counts for their own entry; this
  // guards against code that does not fit them all the same).
  if (e.state == State::Trial && !e.trial.empty() && !fits(*e.trial[0], l)) return;
  e.times.record(0, seconds, kTier0Runs);
  if (e.state == State::Trial) {  // tier 0's turn in the trial
    ++e.trial_runs;
    finish_trial(t, e, dropped);
    return;
  }
  if (e.state != State::Cold) return;
  if (++e.hits == 1) {
    lock.unlock();
    std::vector<uint64_t> first = constant_values(g);
    lock.lock();
    entry_for(t, key, dropped).first_values = std::move(first);
    return;
  }
  if (e.hits < hits || !t.compiler) return;
  std::vector<uint64_t> first = e.first_values;
  lock.unlock();
  const std::string why = ineligible(g, l);
  std::shared_ptr<CompileRequest> req = why.empty() ? request_for(g, key, l, varying_constants(g, first)) : nullptr;
  lock.lock();
  Entry& again = entry_for(t, key, dropped);
  if (again.state != State::Cold) return;
  if (!req) {
    again.state = State::Rejected;
    t.last_error = "not compiled: " + why;
    return;
  }
  again.state = State::Queued;
  again.request = req;
  runtime::counters().tier1_hot_graphs++;
  t.queue.push_back(std::move(req));
  t.cv.notify_all();
}

} // namespace torch_mgpu::engine
