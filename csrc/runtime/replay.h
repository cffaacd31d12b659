#pragma once
// Replay: a hot plan on stream lanes captured once into one graph across the
// lanes' streams (a CUDA graph on a GPU) and replayed with one launch, so
// that the host leaves the steady state. What cannot be captured is known
// before any capture, from the graph, its plan and the lanes: such a graph
// runs as it does now (tier 0 or tier 1), with the reason.
#include "ir/graph.h"
#include "plan/plan.h"
#include "runtime/place.h"

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace torch_mgpu::runtime {

struct ReplayLimits {
  // What one captured graph's memory pool may hold: the bytes of every value
  // its nodes make (outputs of ops, in-place copies of operands), which stay
  // allocated between replays.
  size_t pool_bytes = size_t(1) << 30;
};

// The first reason the run of plan `p` of graph `g` on `places` cannot be
// captured and replayed, nullopt where it can:
// - a lane the plan uses is not a stream lane (host lanes, remote lanes):
//   only work queued on streams is captured;
// - the stream lanes are on more than one device (values would cross
//   devices inside the graph);
// - an op has no kernel for its lane's device (it would run on the host,
//   with a copy there and back: a host sync inside the graph);
// - an op draws random numbers from a seeded generator (a replay would draw
//   the same numbers again);
// - the values the graph makes need more than `limits.pool_bytes`.
std::optional<std::string> replay_blocker(const ir::Graph& g, const plan::Plan& p, const std::vector<Place>& places,
                                          const ReplayLimits& limits = {});

} // namespace torch_mgpu::runtime
