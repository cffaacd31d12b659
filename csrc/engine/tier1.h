#pragma once
// Tier 1's steps (inside engine/ only): a hot graph's hashes and eligibility,
// its parts and the requests the compile thread takes (tier_requests.cpp),
// and a run of compiled code on the lanes (tier_run.cpp). tiers.cpp keeps
// the registry of hot graphs, the compile queue and the trial.
#include "engine/tiers.h"
#include "ir/env.h"
#include "ir/fork_order.h"
#include "capture/lazy_tensor.h"
#include "capture/state_lock.h"
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

namespace torch_mgpu::engine::tier1 {

// The graph's values, numbered as a CompileRequest numbers them: the leaves
// (values read from outside the graph) in first-use order, then every
// node's outputs in node order; and the roots the graph computes, without
// repeats. The same for every graph of one key.
struct Numbering {
  std::vector<ir::Value> leaves;
  std::vector<int> first;                 // first[i]: the number of node i's output 0
  std::vector<std::pair<int, int>> outputs;  // (node, output) of number first[0] + j
  std::vector<int> roots;                 // value numbers
  std::vector<std::pair<int, int>> root_outputs;  // (node, output) of each root

  int count() const { return first.empty() ? 0 : first.back(); }
  // The number of `v`, a leaf or an output of g's node `i` (-1: a leaf).
  int of(const ir::Value& v, int i) const {
    if (i >= 0) return first[static_cast<size_t>(i)] + static_cast<int>(v.index);
    for (size_t k = 0; k < leaves.size(); ++k)
      if (leaves[k] == v) return static_cast<int>(k);
    return -1;
  }
};

// A Python number passed where a tensor goes (`x * 2`): a 0-dim CPU tensor.
bool wrapped_number(const c10::IValue& v);

// A tensor constant's dtype, sizes and bytes.
uint64_t tensor_value_hash(const at::Tensor& t);

// Constants by value: the structural hash sees floating ones by class only
// (so that plans are shared) and tensor constants (numbers wrapped as 0-dim
// tensors, `x + 3`; CPU tensors passed to an op) by dtype and shape; compiled
// code bakes them in, so their values must match the ones it was compiled
// with.
uint64_t exact_hash(const c10::IValue& v);

// Graphs are counted, queued and compiled by structure (the plan cache's
// hash: floating constants by class) and by the lanes they run on: code is
// compiled for its lanes (a part per lane, the lanes' device, stream or
// host lanes), so after configure() changes them for good the graph gets
// hot and compiled there too, and going back finds the code of before.
uint64_t key_of(const ir::Graph& g, const Lanes& l);

bool is_lifted(const std::vector<std::pair<int, int>>& lifted, int node, int arg);

uint64_t fixed_hash(const ir::Graph& g, const std::vector<std::pair<int, int>>& lifted);

uint64_t fixed_hash(const CompileRequest& r, const std::vector<std::pair<int, int>>& lifted);

// Each constant argument's exact hash, in node and argument order.
std::vector<uint64_t> constant_values(const ir::Graph& g);

// The constants whose values differ from `first`.
std::vector<std::pair<int, int>> varying_constants(const ir::Graph& g, const std::vector<uint64_t>& first);

// A lifted constant's value as the compiled code takes it.
at::Tensor lifted_input(const c10::IValue& v, c10::Device device);

Numbering number(const ir::Graph& g);

size_t stored_bytes(const ir::Value& v);

bool plain_constant(const c10::IValue& v);

// add/sub of bool tensors with an alpha other than 1: inductor's CPU code
// for it stores int64 vectors through the bool result's pointer (eight
// bytes per one-byte element: past its buffer, a corrupted heap).
bool bool_sum_with_alpha(const ir::Node& n);

// Why tier 1 may not run `g` on lanes `l` (see tiers.h), or "" when it may.
std::string ineligible(const ir::Graph& g, const Lanes& l);

inline bool eligible(const ir::Graph& g, const Lanes& l) { return ineligible(g, l).empty(); }

// The parts of `g` worth compiling apart and running side by side on the
// lanes `l`: plan::split_along_lanes (plan/pieces.h) over its ops priced by
// the plan's model.
std::vector<std::vector<int>> split_for_lanes(const ir::Graph& g, const Lanes& l, std::vector<int>& part_lane,
                                              std::vector<int>& part_of);

// The request for the nodes `nodes` of `g` (ascending): its leaves are the
// values they read that none of them makes, its roots the values they make
// that the sync needs or `needed` marks (read by another part).
CompileRequest request_of(const ir::Graph& g, const Numbering& nb, const std::vector<int>& nodes,
                          const std::vector<char>& needed);

// The request for hot graph `g` (`varying`: its constants whose values
// changed between its tier-0 runs), with its parts where it splits over the
// lanes `l` (split_for_lanes).
std::shared_ptr<CompileRequest> request_for(const ir::Graph& g, uint64_t key, const Lanes& l,
                                            std::vector<std::pair<int, int>> varying);

// Runs `c` on `g`'s leaves through runtime::execute, each compiled part a
// runtime::Part on its lane (tier_run.cpp); the roots' bytes in an
// ExecResult as tier 0 would leave them. Throws when the compiled code does
// (nothing written: compiled code writes no input). A split graph runs its
// parts on the lanes, each lane its parts in order, each part once the
// parts it reads from are done; `threads`: the intra-op threads of each
// lane.
runtime::ExecResult call(const ir::Graph& g, const CompiledGraph& c, const Lanes& l, int threads);

} // namespace torch_mgpu::engine::tier1
