#pragma once
// Running at the call: the way a repeated trace runs when its lazy run
// measures slower than eager's. A *trace* is the ops a program calls between
// two of its reads (a sync, a copy to the host, `item()`), in call order,
// known by a hash of the ops. The lazy way records them and runs them at the
// read (capture, a sync, tier 0 or 1 on the lanes); the ways at the call run
// each op's CPU kernel from its call, as eager does (backend/eager.cpp's
// eager path, no recording and no sync), with the caller's intra-op threads
// or with one. A trace seen often enough is tried each way in turn, in
// blocks of an untimed run and timed ones in a row (ir::Trial, the lazy way
// the baseline), and runs the way that measured fastest; the choice is tried again after a number of runs that doubles
// while it holds; between trials the choice is made again where the chosen
// way's runs drift from what its trial measured (kDrift). A trace is timed from its first op to the
// end of its read. A trace is told at its first op by the trace that last
// followed the one before it: a loop's traces come in the same order.
// Only host lanes run ops at the call (CUDA lanes keep their values on the
// device). docs/EXECUTION.md, "Running at the call".
#include "ir/lru.h"
#include "ir/trial.h"

#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace torch_mgpu::engine::at_call {

enum class Way : uint8_t { Lazy = 0, AtCall = 1, AtCallOneThread = 2 };
const char* way_name(Way w);

// A trace seen this many times is tried (runs of the lazy way: tier 1's
// compile of its graph is queued by then).
constexpr size_t kHotRuns = 4;
// Timed runs of each way that decide. Six, not three: the ways of a small
// trace often differ by 10-20%, and on a loaded machine a median of three
// took the slower one in one run of three (a 64-feature transform: the
// lazy way 4.6 ms, at the call 5.3-5.6; see docs/EXECUTION.md).
constexpr size_t kTrialRuns = 6;
// The ways take turns in blocks of kBlockRuns timed runs, each after an
// untimed run (the way's cold run, or the first run after a switch, which
// pays the switch): a while of a slower machine (another process's burst)
// then falls on a block, not on all of one way's runs. Blocks of two: a
// burst over one block leaves the median of six (its upper one, the 4th)
// to the other runs. Way after way in one block each, eight branches of
// 128 chose one thread (1.12 ms a run) over the caller's two (eager with
// two beside it: 0.70 ms) on a machine another process loaded.
constexpr size_t kBlockRuns = 2;
// Runs of each way in a trial: its timed runs and an untimed one per block.
constexpr size_t kRunsPerWay = kTrialRuns + kTrialRuns / kBlockRuns;
static_assert(kTrialRuns % kBlockRuns == 0, "a trial's timed runs come in whole blocks");
// Runs of the chosen way before it is tried again; doubled (up to
// kMaxRetry) each time the same way wins again.
constexpr size_t kFirstRetry = 32;
constexpr size_t kMaxRetry = 4096;
// Between trials, the chosen way's runs are timed in groups of
// kSteadyRuns: where their median is over kDrift times what its trial
// measured, that median becomes its measure, and the trial's rule picks
// again over the measures: five runs of each way on a loaded machine may
// mislead (a 103-op training step chose its lazy way in one process of
// six, then ran 5.2-8.2 ms a step against 2.9-4.5 at the call with one
// thread), and the machine may change. Not while tier 1 compiles.
constexpr size_t kSteadyRuns = 8;
constexpr double kDrift = 1.25;
// The lazy way's runs are no measure while tier 1 is deciding about the
// trace's graph (its compile queued, its trial taking turns with tier 0):
// the lazy block of a trial runs on untimed until tier 1 settled, and the
// chosen lazy way's drift is not measured; after this many such runs of a
// trial and since, they are measured all the same.
constexpr size_t kMaxUnsettledRuns = 48;

// What the choice of one trace holds, as stats report it.
struct TraceReport {
  uint64_t trace = 0;
  size_t ops = 0;
  size_t runs = 0;
  std::string way;    // "lazy", "at the call", "at the call, one thread"
  std::string state;  // "watched", "on trial", "chosen"
  std::vector<double> medians_s;  // per way of its last trial; the chosen way's runs since, where they drifted (kDrift)
  std::string why;
};

// The choices per trace: bookkeeping only (no clock, no lock: the caller
// times and guards it; tests feed it times).
class Choices {
 public:
  // The ways tried: the lazy way and at the call, and at the call with one
  // intra-op thread where the caller has more than one.
  explicit Choices(bool one_thread_way = true) : one_thread_(one_thread_way) {}
  // A trace begins: the way its ops take (that of the trace predicted to
  // come). `may_try`: whether a trial may start or go on now.
  Way begin(bool may_try);
  // The trace that began ended: `trace` its hash, `ops` its op count,
  // `seconds` from its first op to the end of its read. `settled`: where it
  // ran the lazy way, whether tier 1 is done deciding about its graphs
  // (else the run is no measure of the lazy way).
  void end(uint64_t trace, size_t ops, double seconds, bool may_try, bool settled = true);
  // Forgets every trace (the lanes changed).
  void clear();
  std::vector<TraceReport> report() const;
  // The way the trace now running takes (Lazy before begin()).
  Way current() const { return current_.way; }

 private:
  enum class State : uint8_t { Watched, Trial, Chosen };
  struct Entry {
    size_t ops = 0;
    size_t runs = 0;
    State state = State::Watched;
    Way way = Way::Lazy;
    ir::Trial trial;
    std::vector<double> medians;  // of the last trial
    size_t since = 0;             // runs of the chosen way since its trial
    size_t retry = kFirstRetry;   // runs of the chosen way before the next trial
    bool decided = false;         // a trial has chosen (`way` is its choice)
    bool has_next = false;
    uint64_t next = 0;  // the trace that followed it last
    size_t block = 0;            // the way whose block of the trial goes on
    size_t block_end = 0;        // its timed runs when the block ends
    bool switched = false;       // the block's first run is still to come (untimed: it pays the switch)
    std::vector<double> recent;  // times of the chosen way since its trial (the latest group)
    std::string drifted;         // what its runs measured, where they drifted (reported)
    bool settled = true;         // tier 1 was done with its graphs at its last lazy run
    size_t unsettled_runs = 0;   // lazy runs since its trial began while tier 1 was not (up to kMaxUnsettledRuns)
  };
  ir::Trial new_trial() const;
  void start_trial(Entry& e) const;
  void decide(Entry& e);
  void steady(Entry& e, double seconds);
  struct Current {
    bool predicted = false;
    uint64_t trace = 0;  // the trace predicted
    Way way = Way::Lazy;
    size_t trial_way = 0;
    bool timed = false;  // a timed run of the trial
  };
  bool one_thread_;
  mutable ir::Lru<uint64_t, Entry> entries_{1024};  // report() walks it in use order
  bool has_last_ = false;
  uint64_t last_ = 0;
  Current current_;
};

// The setting: "auto" (the measured choice, the default), "on" (every call
// at its call, on host lanes), "off" (the lazy way). TORCH_MGPU_AT_CALL or
// configure(at_call=...). The choices made stay for when it is "auto" again.
void set_mode(const std::string& mode);
std::string mode();

// A call about to be recorded (backend::record_call, under the state lock):
// counts it into the trace and says how it runs. `op` names the op (its
// schema's address); where the trace is being measured ("auto"), the sizes
// its arguments `args` work on (call_shape) go into the trace's hash too:
// the same ops over other sizes are another trace, with a choice of its own.
Way on_call(const void* op, c10::ArrayRef<c10::IValue> args);

// The sizes a call works on, hashed: its first tensor's (with its dtype),
// or its first tensor list's first element's and length, else its first
// list of ints (a factory's size), else 0.
uint64_t call_shape(c10::ArrayRef<c10::IValue> args);

// A read of the program's values (a sync, a copy to the host, an op that
// runs eagerly because it reads them): the trace in progress ends when the
// outermost read on this thread is done (reads nest: an op that reads may
// sync). Holds no lock; takes the state lock at its end.
class ProgramRead {
 public:
  ProgramRead();
  ~ProgramRead();
  ProgramRead(const ProgramRead&) = delete;
  ProgramRead& operator=(const ProgramRead&) = delete;
};

// Every trace's choice (torch_mgpu.trace_choices()).
std::vector<TraceReport> report();
// Forgets every trace's choice (configure() with other lanes).
void forget();

} // namespace torch_mgpu::engine::at_call
