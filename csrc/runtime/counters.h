#pragma once
// Process-wide counters behind torch_mgpu.stats(), bumped by every layer
// from the runtime up.
#include <atomic>
#include <cstdint>

namespace torch_mgpu::runtime {

// Each counter on its own cache line: the recording thread and the lanes
// bump different counters at once.
struct Counters {
  alignas(64) std::atomic<int64_t> ops_captured{0};
  alignas(64) std::atomic<int64_t> ops_executed{0};
  alignas(64) std::atomic<int64_t> plans_built{0};
  alignas(64) std::atomic<int64_t> plan_cache_hits{0};
  // Plans with lanes on other ranks that measured slower than one lane
  // (engine/plan_cache.cpp learn): their graphs run on one lane.
  alignas(64) std::atomic<int64_t> plans_measured_slower{0};
  alignas(64) std::atomic<int64_t> eager_fallbacks{0};
  // Nodes of CUDA lanes whose op has no CUDA kernel, run on the host.
  alignas(64) std::atomic<int64_t> host_nodes{0};
  alignas(64) std::atomic<int64_t> bytes_transferred{0};
  alignas(64) std::atomic<int64_t> syncs{0};
  alignas(64) std::atomic<int64_t> meta_cache_hits{0};
  alignas(64) std::atomic<int64_t> meta_cache_misses{0};
  // Callers of recorded ops named from the caches without taking the GIL
  // (python/caller.cpp).
  alignas(64) std::atomic<int64_t> callers_without_gil{0};
  alignas(64) std::atomic<int64_t> execution_errors{0};
  // Cumulative microseconds per sync phase.
  alignas(64) std::atomic<int64_t> sync_graph_us{0};
  alignas(64) std::atomic<int64_t> sync_plan_us{0};
  alignas(64) std::atomic<int64_t> sync_execute_us{0};
  alignas(64) std::atomic<int64_t> sync_bind_us{0};
  alignas(64) std::atomic<int64_t> sync_report_us{0};  // last_plan()'s record, learning from the run
  // Background execution: flights launched, and microseconds a recording or
  // syncing thread waited for one to finish.
  alignas(64) std::atomic<int64_t> background_flushes{0};
  alignas(64) std::atomic<int64_t> background_wait_us{0};
  // Tiered execution (engine/tiers.h): graphs queued for compiling, compiled
  // (and the seconds it took, in us), runs of compiled code, runs that
  // failed and went back to tier 0, compiled graphs dropped (slower than
  // tier 0, or the compiler could not take them); the time tier-1 runs
  // spent inside the compiled code (the rest of sync_execute_us is theirs
  // around it: checks, inputs, outputs).
  // Lanes on other ranks: programs run there, structures sent (a worker
  // keeps each: later runs send its key), bytes sent to and received from
  // workers (values, programs, headers).
  alignas(64) std::atomic<int64_t> remote_programs{0};
  alignas(64) std::atomic<int64_t> remote_structures_sent{0};
  alignas(64) std::atomic<int64_t> remote_bytes_sent{0};
  alignas(64) std::atomic<int64_t> remote_bytes_received{0};
  // Values one worker sent another (counted here when the maker reports).
  alignas(64) std::atomic<int64_t> remote_bytes_between_workers{0};
  alignas(64) std::atomic<int64_t> tier1_hot{0};
  alignas(64) std::atomic<int64_t> tier1_compiled{0};
  alignas(64) std::atomic<int64_t> tier1_compile_us{0};
  alignas(64) std::atomic<int64_t> tier1_runs{0};
  alignas(64) std::atomic<int64_t> tier1_call_us{0};
  alignas(64) std::atomic<int64_t> tier1_fallbacks{0};
  alignas(64) std::atomic<int64_t> tier1_rejected{0};
};

Counters& counters();

} // namespace torch_mgpu::runtime
