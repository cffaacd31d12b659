#pragma once
// Replay of hot plans in the sync (runtime/replay.h): a graph on stream
// lanes that syncs again and again, with the same structure, the same
// constants and the same input sizes, has one run recorded, and later syncs
// of it copy their inputs into the recording's own input bytes and replay
// it, with no plan, no per-node dispatch, no capture of a new graph's bytes:
// on a GPU one CUDA graph launch.
//
// Off by default (replay_hits() 0) until replay has been measured on a GPU;
// once on, a recorded graph's replays compete with the way it runs without
// them (tier 0 or 1) in a trial (ir::Trial) and are kept only where they
// measure faster. On a GPU a replay is one launch of a CUDA graph captured
// from the recording (runtime::capture); elsewhere, or where the capture
// fails, the recorded steps are issued again. What cannot be
// replayed (runtime::replay_blocker, a node under non-default settings, a
// run that crossed devices) is known before recording and kept with the
// graph: it runs in tier 0 or 1, and last_plan() says why.
#include "engine/execution.h"

#include <optional>
#include <string>

namespace torch_mgpu::engine {

// Syncs of one graph counted before its next run is recorded (0: replay off).
int replay_hits();
void set_replay_hits(int hits);
// Drops every recording (configure() changing the lanes, tests).
void clear_replays();
// What the recordings kept at once may hold: the bytes of their pools and
// their count. A new recording past either drops the least recently used
// others (their graphs record again when hot again; stats()
// replay_evicted counts them).
struct ReplayPoolLimit {
  size_t bytes = size_t(2) << 30;
  size_t recordings = 64;
};
ReplayPoolLimit replay_pool_limit();
void set_replay_pool_limit(ReplayPoolLimit limit);

// Whether a recorded graph's replays are measured against the way it runs
// without them (tier 0 or 1, as the sync picks) before replay is kept: on
// by default; the replay tests turn it off to replay every time.
bool replay_trial();
void set_replay_trial(bool on);

// Whether what keeps a recording from capture is looked for before its
// capture (runtime::capture_blocker): on by default; a GPU test turns it
// off to make a capture fail.
bool capture_checks();
void set_capture_checks(bool on);

struct ReplayRun {
  bool recorded = false;  // this run was recorded (it ran in tier 0)
  bool replayed = false;  // this run was a replay
  bool captured = false;  // ... a launch of its CUDA graph
  std::string why;        // why the graph is not replayed ("" when it is, or not yet hot)
  std::string note;       // how it replays (a capture that failed, the trial's verdict)
  size_t steps = 0;       // the recording's steps
  // A replay's inputs, and those of them it copied into the recording's
  // bytes (a leaf that is the very value copied at the last replay, which
  // no step writes, is not copied again: weights, persistent buffers).
  size_t inputs = 0, inputs_copied = 0;
  // On trial (replay_trial()): the graph's key and the way this run is
  // (0: without replay, 1: replayed), and whether its time counts (not a
  // way's cold first run). The sync reports the run's seconds (observe_replay).
  uint64_t key = 0;
  int way = -1;
  bool timed = false;
};

// A run on trial took `seconds` (planning and running it). Once both ways
// have their timed runs, replay is kept where its median is
// ir::margin::kReplay times faster, else its recording is dropped and the
// graph runs without it, saying so.
void observe_replay(const ReplayRun& run, double seconds);

// Runs `g` by replaying its recording where it has one (the results bound
// as tier 0 leaves them: the roots in fresh bytes of their own), or records
// this run when it has just become hot; nullopt when neither (tier 1 or 0
// runs it). A replay that fails drops the recording and returns nullopt:
// it wrote only the recording's own bytes, so tier 0 runs the graph anew.
std::optional<runtime::ExecResult> run_replay(const ir::Graph& g, const Lanes& l, const plan::Plan& p, ReplayRun& run);

} // namespace torch_mgpu::engine
