#pragma once
// Tiered execution. Tier 0 runs a graph node by node (plan, lanes). A graph
// that syncs again and again, the same structure with the same constants, is
// "hot": after `compile_hits()` tier-0 runs it is handed to a compiler that
// works in the background (inductor, from Python: torch_mgpu/_tiers/),
// which returns one function for the whole graph (and, for a graph with
// independent branches, one per part: see below). Later syncs of that graph
// run the compiled code (tier 1), first as a trial in which the compiled ways
// and tier 0 take turns: the fastest way is kept only if it measures faster
// than tier 0 in the same trial, else the graph stays in tier 0 (a second
// trial of kept code that slowed down times it against the tier-0 runs
// just made). A
// compiled function is pure (it writes no input), so a run that fails is
// run again in tier 0, which raises what it would have raised.
//
// A graph with independent branches compiles as parts (torch.compile's
// split: engine.h's split_groups), run on the lanes side by side, each after
// the parts it reads: tier 1 keeps tier 0's parallelism and fuses within
// each part.
//
// Only graphs whose every node is a plain ATen op are compiled: no random
// draws, no partitions of torch.compile graphs, no out= resizes, the default
// call settings (see eligible()), on lanes of one device: host lanes, or the
// streams of one GPU (or CPU stream lanes under the stream-order
// sanitizer), where each part runs on its lane's stream after waiting on
// the events of the parts it reads, as the executor orders nodes.
#include "engine/execution.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch_mgpu::engine {

// The graph as the compiler gets it: plain data, no storage held. Values are
// numbered: the leaves (storages the graph reads but does not compute) 0 ..
// leaves.size() - 1, then every node output in order.
//
// A graph with independent branches is split (see above): `parts` are then
// the requests the compiler compiles (each a graph of its own, numbered as
// above), one inductor function each, run on their lanes side by side; the
// request's own nodes are the whole graph.
struct CompileRequest {
  uint64_t key = 0;
  struct Leaf {
    size_t nbytes = 0;
  };
  struct Node {
    c10::OperatorHandle op;
    std::vector<ir::Arg> args;       // tensors name operands by position
    std::vector<int> operands;       // value number of each operand
    std::vector<ir::Output> outputs;
    std::vector<int> output_values;  // value number of each output
    std::vector<ir::Written> written;  // the tensor arguments it writes, with their geometry after
  };
  std::vector<Leaf> leaves;
  std::vector<Node> nodes;
  std::vector<int> roots;  // value numbers the sync needs back, in order
  // Constants (node, argument) whose values changed between the runs that
  // made the graph hot: the ones worth making inputs of the compiled code
  // (the others are compiled in, where inductor folds them).
  std::vector<std::pair<int, int>> varying;

  // A part of a split graph: its lane, and its nodes, leaves and roots as
  // the whole graph numbers them (node indices; value numbers).
  int lane = 0;
  std::vector<int> whole_nodes, whole_leaves, whole_roots;
  std::vector<CompileRequest> parts;  // empty: the graph compiles whole
  int lanes = 1;                      // lanes the parts run on (their loops share the cores)
  std::string device = "cpu";         // where the lanes run: the compiled code's device ("cpu", "cuda:0")
  bool streams = false;               // the lanes are streams (events between parts)
};

// What the compiler returns, per part (the whole graph is one part): inputs
// are its leaves' bytes as flat tensors of `input_dtypes`; outputs one
// tensor per root, a fresh output in its geometry (or any layout: it is then
// copied into it), a storage written in place as a flat tensor of its bytes.
struct CompiledPart {
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> run;
  std::vector<c10::ScalarType> input_dtypes;
  // Floating constants (node, argument of the part's own nodes) that are
  // inputs of the compiled code (0-dim float64 tensors after the leaves).
  std::vector<std::pair<int, int>> lifted;
  std::string description;
};

struct CompiledGraph {
  // One part (the whole graph, run on the syncing thread), or the parts of
  // a split graph (each on its lane, after the parts it reads).
  std::vector<CompiledPart> parts;
  // Set by install_compiled(): each part's lane, leaves, roots and the
  // parts it waits for; the lifted constants as the whole graph numbers
  // them. A learning rate that changes every step does not make another
  // graph; the other constants are baked in: `fixed` hashes their values,
  // and a graph whose values differ runs in tier 0.
  struct Layout {
    int lane = 0;
    std::vector<int> nodes;          // its nodes in the whole graph
    std::vector<int> leaves, roots;  // value numbers of the whole graph
    std::vector<int> after;          // parts it reads from
    std::vector<std::pair<int, int>> lifted;
  };
  std::vector<Layout> layout;
  std::vector<std::pair<int, int>> lifted;
  uint64_t fixed = 0;
  int lanes = 1;
  // The lanes it was compiled for (install_compiled, from the request):
  // the entry's key has them; code that does not fit the lanes of a run
  // is not called.
  std::string device = "cpu";
  bool streams = false;
  double compile_s = 0;
  std::string description;  // for last_plan()
};

// The hit count at which a graph is compiled (graphs counted by structure:
// their constants' classes, not their values): kDefaultCompileHits unless
// TORCH_MGPU_COMPILE (or configure(compile=)) says otherwise; 0: tiering
// off. A process without a compiler (C++ without Python) counts nothing.
constexpr int kDefaultCompileHits = 2;
int compile_hits();
void set_compile_hits(int hits);
// Whether compiled code must measure faster to be kept (the default); off,
// it is kept once compiled (tests of tier 1 itself).
void set_compile_trial(bool on);
bool compile_trial();

// The compile thread's side (Python): waits for the next hot graph (null
// once stop_compiles() was called); installs or rejects what it compiled.
std::shared_ptr<const CompileRequest> next_compile_request();
// `ways`: the whole graph compiled as one part and, for a split request, its
// parts; on trial, each way is timed and the fastest kept if it beats tier 0.
// Each way's layout and `fixed` are set here, from the request; a way whose
// parts do not match the request's is dropped.
void install_compiled(uint64_t key, std::vector<std::shared_ptr<CompiledGraph>> ways);
void reject_compiled(uint64_t key, const std::string& why);
void stop_compiles();
// Waits until no hot graph is queued or being compiled (up to `seconds`);
// true when none is.
bool wait_for_compiles(double seconds);
// Why the last graph left tier 1 (compiler error, failed run, slower), or "".
std::string last_tier_error();
// Whether a compile thread serves the requests (set by the thread itself).
void set_compiler_present(bool present);

// The sync's side (Execution::run). `tier1` runs `g` with its compiled
// function if it has one worth a run; null when it has none, or when the run
// failed (then tier 0 must run it: nothing was written).
struct TierRun {
  uint64_t key = 0;
  std::shared_ptr<const CompiledGraph> compiled;  // tier 1 ran with it
  std::string choice;  // kept code: what its trial measured (each way compiled, and tier 0)
  bool failed = false;  // compiled code was called and threw (tier 0 then ran: no measure of either)
};
// `caller_threads`: the intra-op threads of the thread that synced (a
// flight runs the compiled code with as many, as it runs a one-lane plan).
std::optional<runtime::ExecResult> run_tier1(const ir::Graph& g, const Lanes& l, int caller_threads, TierRun& run);
// After a run: counts tier-0 hits (queues a hot graph for compiling), and
// keeps or drops a compiled graph on trial by the seconds measured.
void observe_tier(const ir::Graph& g, const Lanes& l, const TierRun& run, double seconds, bool failed);
// Runs observe_tier counted whose graph tier 1 was still deciding about
// (cold with a compiler present, queued, compiling or on trial), so far: a
// run of a program's graphs that leaves it unchanged ran the way it will
// keep running.
uint64_t unsettled_runs();

} // namespace torch_mgpu::engine
