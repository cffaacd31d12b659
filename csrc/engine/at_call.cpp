// Running at the call (engine/at_call.h): the choice per trace, and the
// trace in progress.
#include "engine/at_call.h"

#include "capture/state_lock.h"
#include "engine/execution.h"
#include "engine/tiers.h"
#include "ir/env.h"
#include "runtime/counters.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace torch_mgpu::engine::at_call {

const char* way_name(Way w) {
  switch (w) {
    case Way::Lazy:
      return "lazy";
    case Way::AtCall:
      return "at the call";
    case Way::AtCallOneThread:
      return "at the call, one thread";
  }
  return "?";
}

ir::Trial Choices::new_trial() const {
  return ir::Trial(one_thread_ ? 3 : 2, kTrialRuns, ir::margin::kAtCall);
}

void Choices::start_trial(Entry& e) const {
  e.state = State::Trial;
  e.trial = new_trial();
  e.block = 0;
  e.block_end = kBlockRuns;
  e.switched = false;  // way 0's first run is its cold one
  e.unsettled_runs = 0;
}

Way Choices::begin(bool may_try) {
  current_ = Current{};
  if (!has_last_) return Way::Lazy;
  const Entry* prev = entries_.peek(last_);
  if (prev == nullptr || !prev->has_next) return Way::Lazy;
  Entry* e = entries_.find(prev->next);
  if (e == nullptr) return Way::Lazy;
  current_.predicted = true;
  current_.trace = prev->next;
  if (e->state == State::Chosen && ++e->since >= e->retry && may_try) start_trial(*e);
  if (e->state == State::Trial && may_try && e->block == 0 && !e->settled && e->unsettled_runs < kMaxUnsettledRuns) {
    // Tier 1 is deciding about the lazy way's graphs: they run on, untimed,
    // until their way is settled.
    current_.way = Way::Lazy;
  } else if (e->state == State::Trial && may_try) {
    // A way runs a block: an untimed run, then kBlockRuns timed ones in a
    // row, what a loop running it meets (switching ways has costs of its
    // own, paid by the run after a switch, which is not timed: the way's
    // cold run, or a warm one after the switch). Then the way called least.
    if (e->trial.seconds(e->block).size() >= e->block_end) {
      e->block = e->trial.turn([&](size_t w) { return !e->trial.timed(w); });
      e->block_end = std::min(e->trial.seconds(e->block).size() + kBlockRuns, kTrialRuns);
      e->switched = e->trial.calls(e->block) > 0;
    }
    current_.trial_way = e->block;
    if (e->switched) {
      e->switched = false;
      current_.timed = false;
    } else {
      current_.timed = e->trial.call(current_.trial_way);
    }
    current_.way = static_cast<Way>(current_.trial_way);
  } else {
    current_.way = e->state == State::Watched ? Way::Lazy : e->way;
  }
  return current_.way;
}

void Choices::end(uint64_t trace, size_t ops, double seconds, bool may_try, bool settled) {
  const Current ran = current_;
  current_ = Current{};
  if (has_last_)
    if (Entry* p = entries_.peek(last_)) {
      p->has_next = true;
      p->next = trace;
    }
  has_last_ = true;
  last_ = trace;
  Entry& e = entries_.get(trace);
  e.ops = ops;
  ++e.runs;
  // A lazy run while tier 1 decides about its graphs is no measure of the
  // lazy way (nor is any run while tier 1 compiles).
  // (A graph tier 1 never settles is measured after kMaxUnsettledRuns.)
  if (ran.way == Way::Lazy) {
    e.settled = settled;
    if (!settled && e.unsettled_runs < kMaxUnsettledRuns) ++e.unsettled_runs;
  }
  const bool measure =
      may_try && (ran.way != Way::Lazy || settled || e.unsettled_runs >= kMaxUnsettledRuns);
  if (e.state == State::Trial && ran.predicted && ran.trace == trace && ran.timed && measure)
    e.trial.record(ran.trial_way, seconds);
  if (e.state == State::Chosen && ran.predicted && ran.trace == trace && ran.way == e.way) {
    if (measure) steady(e, seconds);
    else e.recent.clear();
  }
  if (e.state == State::Watched && e.runs >= kHotRuns && may_try) {
    start_trial(e);
  } else if (e.state == State::Trial && e.trial.all_timed()) {
    decide(e);
  }
}

void Choices::decide(Entry& e) {
  e.medians.clear();
  for (size_t w = 0; w < e.trial.size(); ++w) e.medians.push_back(e.trial.median_of(w));
  const Way won = static_cast<Way>(e.trial.choose());
  e.retry = e.decided && won == e.way ? std::min(e.retry * 2, kMaxRetry) : kFirstRetry;
  e.decided = true;
  e.way = won;
  e.state = State::Chosen;
  e.since = 0;
  e.recent.clear();
  e.drifted.clear();
}

void Choices::steady(Entry& e, double seconds) {
  e.recent.push_back(seconds);
  if (e.recent.size() < kSteadyRuns) return;
  const double ran = ir::median(e.recent);
  e.recent.clear();
  const auto chosen = static_cast<size_t>(e.way);
  if (chosen >= e.medians.size() || ran <= kDrift * e.trial.median_of(chosen)) return;
  // Slower than its trial measured it: this time is its measure, and the
  // trial's rule picks again over the measures.
  e.medians[chosen] = ran;
  e.drifted = std::string(way_name(e.way)) + " then ran " + std::to_string(static_cast<int64_t>(ran * 1e6)) +
      " us (median of " + std::to_string(kSteadyRuns) + ")";
  const size_t best = ir::choose_by_medians(e.medians, ir::margin::kAtCall);
  if (best == chosen) return;
  e.way = static_cast<Way>(best);
  e.since = 0;
  e.retry = kFirstRetry;
}

void Choices::clear() {
  entries_.clear();
  has_last_ = false;
  current_ = Current{};
}

std::vector<TraceReport> Choices::report() const {
  std::vector<TraceReport> out;
  entries_.for_each([&](const uint64_t& k, const Entry& e) {
    TraceReport r;
    r.trace = k;
    r.ops = e.ops;
    r.runs = e.runs;
    r.way = way_name(e.state == State::Watched ? Way::Lazy : e.way);
    r.state = e.state == State::Watched ? "watched" : e.state == State::Trial ? "on trial" : "chosen";
    r.medians_s = e.medians;
    if (e.state == State::Watched) {
      r.why = "seen " + std::to_string(e.runs) + " times (tried from " + std::to_string(kHotRuns) + ")";
    } else if (!e.medians.empty()) {
      r.why = "measured";
      for (size_t w = 0; w < e.medians.size(); ++w)
        r.why += std::string(w ? "," : "") + " " + way_name(static_cast<Way>(w)) + " " +
            std::to_string(static_cast<int64_t>(e.medians[w] * 1e6)) + " us";
      r.why += " (median of " + std::to_string(kTrialRuns) + ")";
      if (!e.drifted.empty()) r.why += "; " + e.drifted;
    } else {
      r.why = "first trial in progress";
    }
    out.push_back(std::move(r));
  });
  return out;
}

namespace {

using clock = std::chrono::steady_clock;

// The trace in progress and every trace's choice. Under the state lock.
struct Tracer {
  Choices choices;
  std::string mode = ir::env::choice(ir::env::Var::AtCall);
  uint64_t hash = 0;
  size_t ops = 0;
  Way way = Way::Lazy;
  bool begun = false;    // the choices told this trace's way (auto, host lanes)
  clock::time_point since;  // the trace's first op
  uint64_t unsettled = 0;   // tier 1's unsettled runs at its first op
};

Tracer& tracer() {
  static auto* t = new Tracer();  // leaked: reads may end during static teardown
  return *t;
}

thread_local int read_depth = 0;

constexpr uint64_t kHashSeed = 0x9e3779b97f4a7c15ull;

// Whether the configured lanes run ops on the host: the only lanes whose
// values an op at its call can read where they lie.
bool host_lanes() {
  auto lanes = current_lanes();
  if (!lanes || lanes->places.empty()) return false;
  for (const auto& p : lanes->places)
    if (p.kind != runtime::LaneKind::Host || !p.device.is_cpu()) return false;
  return true;
}

// A trial neither starts nor goes on while tier 1 compiles: the lazy way's
// times would be those of a graph about to change way.
bool may_try() { return wait_for_compiles(0); }

} // namespace

void set_mode(const std::string& mode) {
  TORCH_CHECK_VALUE(mode == "auto" || mode == "on" || mode == "off",
                    "at_call must be 'auto', 'on' or 'off' (or True / False), got '", mode, "'");
  capture::StateLock lock;
  auto& t = tracer();
  t.mode = mode;
  // The choices made stay (their times hold on these lanes: a program that
  // turns the setting off for a while finds them when it turns it back).
  // The trace in progress is no measure of anything: its next op starts a
  // trace of the new mode's way.
  t.ops = 0;
  t.way = Way::Lazy;
  t.begun = false;
}

std::string mode() {
  capture::StateLock lock;
  return tracer().mode;
}

namespace {

uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ull; }

} // namespace

uint64_t call_shape(c10::ArrayRef<c10::IValue> args) {
  auto of = [](const at::Tensor& t) {
    uint64_t h = mix(kHashSeed, static_cast<uint64_t>(t.scalar_type()) << 8 | static_cast<uint64_t>(t.dim()));
    for (const int64_t d : t.sizes()) h = mix(h, static_cast<uint64_t>(d));
    return h;
  };
  for (const auto& v : args) {
    if (v.isTensor()) {
      if (!v.toTensor().defined()) continue;
      return of(v.toTensor());
    }
    if (v.isTensorList()) {  // cat, the foreach ops: the first element's
      const auto l = v.toTensorList();
      if (l.empty()) continue;
      const at::Tensor first = l.get(0);
      if (!first.defined()) continue;
      return mix(of(first), l.size());
    }
    if (v.isIntList()) {
      uint64_t h = mix(kHashSeed, 0x51ull);
      for (const int64_t d : v.toIntList()) h = mix(h, static_cast<uint64_t>(d));
      return h;
    }
  }
  return 0;
}

Way on_call(const void* op, c10::ArrayRef<c10::IValue> args) {
  auto& t = tracer();
  if (t.ops == 0) {
    t.since = clock::now();
    t.unsettled = unsettled_runs();
    t.hash = kHashSeed;
    t.begun = false;
    if (t.mode == "off" || !host_lanes()) {
      t.way = Way::Lazy;
    } else if (t.mode == "on") {
      t.way = Way::AtCall;
    } else {
      t.way = t.choices.begin(may_try());
      t.begun = true;
    }
  }
  if (t.begun) {  // only a measured trace's hash is read
    t.hash = mix(mix(t.hash, reinterpret_cast<uintptr_t>(op)), call_shape(args));
    t.hash ^= t.hash >> 29;
  }
  ++t.ops;
  return t.way;
}

ProgramRead::ProgramRead() { ++read_depth; }

ProgramRead::~ProgramRead() {
  if (--read_depth > 0) return;
  try {
    capture::StateLock lock;
    auto& t = tracer();
    const auto now = clock::now();
    if (t.ops > 0) {
      const double seconds = std::chrono::duration<double>(now - t.since).count();
      if (t.way != Way::Lazy) runtime::counters().at_call_traces++;
      if (t.begun) t.choices.end(t.hash, t.ops, seconds, may_try(), unsettled_runs() == t.unsettled);
      t.ops = 0;
      t.way = Way::Lazy;
      t.begun = false;
    }
  } catch (...) {
    // Bookkeeping only: a read that cannot be counted (memory ran out) is
    // no error of the program's.
  }
}

std::vector<TraceReport> report() {
  capture::StateLock lock;
  return tracer().choices.report();
}

void forget() {
  capture::StateLock lock;
  auto& t = tracer();
  t.choices.clear();
  t.ops = 0;
  t.way = Way::Lazy;
  t.begun = false;
}

} // namespace torch_mgpu::engine::at_call
