#pragma once
// Tiered execution. Tier 0 runs a graph node by node (plan, lanes). A graph
// that syncs again and again, the same structure with the same constants, is
// "hot": after `compile_hits()` tier-0 runs it is handed to a compiler that
// works in the background (inductor, from Python: torch_mgpu/_tiers.py),
// which returns one function for the whole graph. Later syncs of that graph
// run the compiled function (tier 1), first as a trial: it is kept only if
// it measures faster than tier 0 did, else the graph stays in tier 0. A
// compiled function is pure (it writes no input), so a run that fails is
// run again in tier 0, which raises what it would have raised.
//
// Only graphs whose every node is a plain ATen op on CPU lanes are compiled:
// no random draws, no partitions of torch.compile graphs, no out= resizes,
// the default call settings (see eligible()).
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
};

// What the compiler returns: inputs are the leaves' bytes as flat tensors of
// `input_dtypes`; outputs one tensor per root, a fresh output in its
// geometry (or any layout: it is then copied into it), a storage written in
// place as a flat tensor of its bytes.
struct CompiledGraph {
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> run;
  std::vector<c10::ScalarType> input_dtypes;
  // Floating constants (node, argument) that are inputs of the compiled code
  // (0-dim float64 tensors after the leaves): a learning rate that changes
  // every step does not make another graph. The other constants are baked
  // in: `fixed` hashes their values, and a graph whose values differ runs
  // in tier 0.
  std::vector<std::pair<int, int>> lifted;
  uint64_t fixed = 0;
  double compile_s = 0;
  std::string description;  // for last_plan()
};

// The hit count at which a graph is compiled (graphs counted by structure:
// their constants' classes, not their values); 0: tiering off (the default;
// TORCH_MGPU_COMPILE=N turns it on at N).
int compile_hits();
void set_compile_hits(int hits);
// Whether compiled code must measure faster to be kept (the default); off,
// it is kept once compiled (tests of tier 1 itself).
void set_compile_trial(bool on);

// The compile thread's side (Python): waits for the next hot graph (null
// once stop_compiles() was called); installs or rejects what it compiled.
std::shared_ptr<const CompileRequest> next_compile_request();
// `compiled->fixed` is set here, from the graph the request was made of.
void install_compiled(uint64_t key, std::shared_ptr<CompiledGraph> compiled);
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
};
// `caller_threads`: the intra-op threads of the thread that synced (a
// flight runs the compiled code with as many, as it runs a one-lane plan).
std::optional<runtime::ExecResult> run_tier1(const ir::Graph& g, const Lanes& l, int caller_threads, TierRun& run);
// After a run: counts tier-0 hits (queues a hot graph for compiling), and
// keeps or drops a compiled graph on trial by the seconds measured.
void observe_tier(const ir::Graph& g, const Lanes& l, const TierRun& run, double seconds, bool failed);

} // namespace torch_mgpu::engine
