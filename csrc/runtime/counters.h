#pragma once
// Process-wide counters behind torch_mgpu.stats(), bumped by every layer
// from the runtime up.
#include <atomic>
#include <cstdint>

namespace torch_mgpu::runtime {

// Every counter, once: its field in Counters is its key in stats() (api.cpp
// walks this list). A new counter is one line here, bumped where it happens.
#define TORCH_MGPU_COUNTERS(X)                                                                              \
  X(ops_captured)                                                                                           \
  X(ops_executed)                                                                                           \
  X(plans_built)                                                                                            \
  X(plan_cache_hits)                                                                                        \
  /* plans with lanes on other ranks that measured slower than one lane: their graphs run on one lane */   \
  X(plans_measured_slower)                                                                                  \
  X(eager_fallbacks)                                                                                        \
  /* ops run at their call (engine/at_call.h), and the traces whose ops ran so */                            \
  X(at_call_ops)                                                                                            \
  X(at_call_traces)                                                                                         \
  /* in-place writes of ops run now (at the call, or eagerly) that went into a copy of the storage's */     \
  /* bytes, something else holding them (a pending node, a device copy, another storage) */                 \
  X(write_copies)                                                                                           \
  X(host_nodes) /* nodes of CUDA lanes whose op has no CUDA kernel, run on the host */                      \
  X(bytes_transferred)                                                                                      \
  X(syncs)                                                                                                  \
  X(meta_cache_hits)                                                                                        \
  X(meta_cache_misses)                                                                                      \
  X(callers_without_gil) /* callers named from python/caller.cpp's caches without taking the GIL */         \
  X(execution_errors)                                                                                       \
  /* cumulative microseconds per sync phase (report: last_plan()'s record, learning from the run) */        \
  X(sync_graph_us)                                                                                          \
  X(sync_plan_us)                                                                                           \
  X(sync_execute_us)                                                                                        \
  X(sync_bind_us)                                                                                           \
  X(sync_report_us)                                                                                         \
  /* flights launched, and microseconds a recording or syncing thread waited for one */                     \
  X(background_flushes)                                                                                     \
  X(background_wait_us)                                                                                     \
  /* lanes on other ranks: programs run there, structures sent (a worker keeps each: later runs send its */ \
  /* key), bytes sent to and received from workers, and values one worker sent another */                   \
  X(remote_programs)                                                                                        \
  X(remote_structures_sent)                                                                                 \
  X(remote_bytes_sent)                                                                                      \
  X(remote_bytes_received)                                                                                  \
  X(remote_bytes_between_workers)                                                                           \
  /* tier 1 (engine/tiers.h): graphs queued for compiling, compiled (and the microseconds it took), runs */  \
  /* of compiled code and the time inside it (the rest of sync_execute_us is theirs around it), runs that */ \
  /* failed and went back to tier 0, compiled graphs dropped (slower, or refused by the compiler) */         \
  X(tier1_hot_graphs)                                                                                       \
  X(tier1_compiled)                                                                                         \
  X(tier1_compile_us)                                                                                       \
  X(tier1_runs)                                                                                             \
  X(tier1_call_us)                                                                                          \
  X(tier1_fallbacks)                                                                                        \
  X(tier1_rejected)                                                                                         \
  /* replay (engine/replays.h): runs replayed, recordings kept now and the bytes they keep, replays that */  \
  /* failed (their recording dropped, the graph run again in tier 0), recordings dropped by the bound */       \
  X(replay_runs)                                                                                            \
  X(replay_recordings)                                                                                      \
  X(replay_pool_bytes)                                                                                      \
  X(replay_dropped)                                                                                         \
  X(replay_evicted)                                                                                         \
  /* recordings captured as CUDA graphs; graphs whose replay measured slower in its trial (not replayed) */   \
  X(replay_captures)                                                                                        \
  X(replay_rejected)

// Each counter on its own cache line: the recording thread and the lanes
// bump different counters at once.
struct Counters {
#define TORCH_MGPU_COUNTER_FIELD(name) alignas(64) std::atomic<int64_t> name{0};
  TORCH_MGPU_COUNTERS(TORCH_MGPU_COUNTER_FIELD)
#undef TORCH_MGPU_COUNTER_FIELD
};

Counters& counters();

} // namespace torch_mgpu::runtime
