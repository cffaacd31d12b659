#pragma once
// Replay: a hot plan on stream lanes captured once into one graph across the
// lanes' streams (a CUDA graph on a GPU) and replayed with one launch, so
// that the host leaves the steady state. What cannot be captured is known
// before any capture, from the graph, its plan and the lanes: such a graph
// runs as it does now (tier 0 or tier 1), with the reason.
#include "ir/graph.h"
#include "plan/plan.h"
#include "runtime/place.h"

#include <c10/core/Storage.h>

#include <cstddef>
#include <functional>
#include <memory>
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

// The first reason the run of plan `p` of graph `g` on `places`, which
// replay_blocker() lets replay, cannot be captured as a CUDA graph, nullopt
// where nothing is known against it: an op on a GPU's lane whose kernel
// reads a value on the host (a check of its result, as linalg.cholesky's;
// a size that depends on values; histc's range read from its input), a
// sync, which a capture refuses. Such a graph replays step by step.
std::optional<std::string> capture_blocker(const ir::Graph& g, const plan::Plan& p, const std::vector<Place>& places);

// What a run on stream lanes queued, lane by lane (execute() with a
// Recording): each lane's waits for other lanes' events, its calls (a node's
// kernel, a compiled part) with the bytes each read and wrote, and the
// events it recorded. Issued again in the same order over the same bytes,
// it computes the graph again from what those bytes then hold: this is what
// a CUDA graph captures, and replay() issues it on any stream lanes (CPU
// stream lanes under the stream sanitizer: the stand-in for a GPU's).
//
// The recording holds every byte the run made (its pool: a replay writes
// them again) and the leaves' bytes as the lanes read them (`inputs`: a
// caller copies new values into them before a replay). What the graph's
// roots hold after a replay is in `outputs`; the next replay writes them
// again, so a value that must outlive it is copied out.
struct Recording {
  struct Step {
    enum class Kind : uint8_t { Wait, Call, Record };
    Kind kind = Kind::Call;
    // Wait, Record: the event, by the graph node it follows (one per node
    // read on another lane).
    int event = -1;
    std::string name;  // Call: the node or part, as the sanitizer names it
    std::vector<c10::Storage> reads, writes;
    // Call: the results from the bytes of `reads`, run at `place` (its
    // stream current); a result in other bytes than its `writes` entry is
    // copied there. A recorded part's call is copied: what it refers to
    // must outlive the recording.
    std::function<std::vector<c10::Storage>(const std::vector<c10::Storage>& reads, const Place& place)> call;
  };
  std::vector<Place> places;
  int threads_per_lane = 1;
  std::vector<std::vector<Step>> lanes;  // by lane; empty for an unused lane
  std::vector<std::pair<ir::Value, c10::Storage>> inputs;   // each leaf read, once
  std::vector<std::pair<ir::Value, c10::Storage>> outputs;  // each root the graph made
  // Why the run cannot be replayed ("" when it can): a node failed, a lane
  // is not a stream lane, a value crossed devices.
  std::string unreplayable;
  // Checks a replay leaves to its end (unchecked_call_of): bytes a call
  // writes its kernel's error codes into, and the node they are of.
  struct Check {
    c10::Storage codes;  // int32, one per matrix
    std::string node;    // describe_node's
  };
  std::vector<Check> checks;

  // Bytes the recording keeps: what its calls wrote (each block once).
  size_t pool_bytes() const;
  // Gives each input bytes of its own, on the same device: every step,
  // input and output that held an input's bytes holds the new ones
  // instead. The run read (and may have written in place) the leaves'
  // own bytes; replays must not, since a caller's tensor keeps them.
  void own_inputs();
};

// What a recorded call of node `n` keeps of it: everything run_node reads,
// not its operands (which would keep the graph before it, and the leaves'
// bytes, alive with the recording).
ir::NodePtr call_of(const ir::Node& n);

// For a node whose kernel checks its result on the host (a sync: on a GPU,
// one a CUDA graph cannot hold) and that has a form without the check
// (linalg.cholesky, linalg.inv: their _ex forms with check_errors=False),
// the recorded call of that form: its results, then its error codes as one
// more output, which the replay checks once it is done
// (raise_failed_checks). nullptr for any other node.
ir::NodePtr unchecked_call_of(const ir::Node& n);

// Throws where a call of the last replay of `r` left an error code that is
// not 0 (its checks): the recording's bytes then do not hold the graph's
// results, and its caller runs the graph anew, which raises the op's own
// error. Reads the codes on the host once every stream is done.
void raise_failed_checks(const Recording& r);

// Issues recording `r` again: each lane's steps in order on its stream (on
// a thread of its own); a Wait waits on the host until the Record of its
// event has been issued, then its stream waits for the event; each Call
// runs over the bytes it read when recorded and leaves its results in the
// bytes it wrote then. Returns when every lane's stream has finished.
// Throws the first error (the recording's bytes then hold what the steps
// before it left: the caller runs the graph anew).
void replay(const Recording& r);

// Issues recording `r` again from this one thread, as a capture issues it:
// every lane's steps queued on its stream, a lane stopping at a Wait whose
// event is not queued yet while the next goes on; no host wait between
// them. Then every stream finishes. On CPU stream lanes under the stream
// sanitizer, the proof of the order a CUDA graph captures.
void replay_from_one_thread(const Recording& r);

// A recording captured as one CUDA graph over its lanes' streams: forked
// from a stream of the capture's own and joined back into it with events,
// every call queued once from one thread (none runs while captured), its
// temporaries in the graph's private memory pool. Its launch computes what
// replay() computes, over the same recorded bytes.
struct Captured;

// Whether `r` can be captured: replayable, on one GPU's streams, in a CUDA
// build.
bool can_capture(const Recording& r);
// Runs `r` once on the streams its capture uses, as the capture issues it
// (replay_from_one_thread: this run's results; the thread's library handles
// and workspaces for those streams are made here, outside any graph), then
// captures it. Throws where that run fails (the recording's bytes then hold
// what its steps before the error left). Where the capture fails (a call
// that synchronizes, or that a graph cannot hold) it returns nullptr with
// the reason in `why_not`: every stream out of capture again, nothing run
// (the run's results stand).
std::shared_ptr<Captured> capture(const Recording& r, std::string& why_not);
// Launches the graph on its device's current stream (after the inputs'
// copies queued there) and waits for it.
void launch(const Captured& c);

} // namespace torch_mgpu::runtime
