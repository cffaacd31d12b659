#pragma once
// torch_mgpu's C++ API: the same verbs as the Python module. Linking
// libtorch_mgpu registers the `mgpu` device; then
//   auto x = torch::randn({4, 4}).to(torch::Device("mgpu"));
// records ops lazily, and x.cpu() or torch_mgpu::synchronize() runs them.
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace torch_mgpu {

// Makes sure the mgpu backend is registered (the library registers it when
// it loads; calling init() also keeps a linker that drops unreferenced
// libraries from dropping it), so that torch::Device("mgpu") parses. Safe to
// call any number of times, from any thread. Errors below are c10::Error.
void init();

// Runs every pending op; raises the first error an op raised.
void synchronize();
// Ops recorded and not yet run.
int64_t pending_ops();
// Counters since start: ops_captured, ops_executed, plans_built,
// plan_cache_hits, eager_fallbacks, bytes_transferred and more.
std::map<std::string, int64_t> stats();
// Releases the host blocks kept for reuse by the lanes (stats()
// "host_cache_bytes"; TORCH_MGPU_HOST_CACHE_MB bounds them, 0 = no cache).
void empty_cache();
// A pending graph larger than this runs at once (TORCH_MGPU_MAX_PENDING).
int64_t max_pending_ops();
void set_max_pending_ops(int64_t n);
// Background execution: once n ops are pending they start running on a
// background worker while capture goes on (default 256, TORCH_MGPU_ASYNC_OPS;
// 0 turns it off). Errors surface at the next sync point.
int64_t async_ops();
void set_async_ops(int64_t n);
// Waits for the background flight in progress, if any. A C++ program calls it
// before changing a process-wide setting that kernels read (the default
// dtype, deterministic mode, matmul precision) while ops may be in flight;
// in Python, torch_mgpu does it inside torch.set_default_dtype and its kin.
void wait_for_flight();
// The mgpu device (index 0: one virtual device spans all lanes).
c10::Device device(int index = 0);

// Lanes: devices {"cpu"} / {"cpu","cpu"} (virtual devices) / {"cuda:0",...},
// lanes per device, policy "auto" | "heft" | "serial". Empty devices or
// policy, or 0 lanes, keep the current value; negative lanes, an unknown
// device or policy raise c10::Error and change nothing. Environment:
// TORCH_MGPU_DEVICES, TORCH_MGPU_LANES, TORCH_MGPU_POLICY.
void configure(const std::vector<std::string>& devices = {}, int lanes_per_device = 0,
               const std::string& policy = "");
std::vector<std::string> lanes();
std::string policy();

// Lanes on other processes: "rankN:cpu" devices are worker rank N of `pg`
// (a torch.distributed process group, Gloo; this process is its rank 0).
// Set the group before configuring such devices. A worker process calls
// serve_as_worker(pg): it runs what rank 0 sends until release_workers()
// (true) or until rank 0 goes away (false).
void set_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);
bool serve_as_worker(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);
void release_workers();

struct TimelineEntry {
  int node;
  std::string op;
  std::string lane;
  double start, end;  // measured, seconds from the start of execution
  double predicted_start, predicted_end;
  int fused = -1;  // the pointwise group it ran in as one pass, -1: alone
  int threads = 0;  // intra-op threads it ran with (0 when simulated)
};

// The plan of the last executed graph.
struct LastPlan {
  bool valid = false;
  std::string text;
  std::string dot;
  std::string policy;
  std::vector<std::string> lanes;
  std::vector<TimelineEntry> timeline;
  int lanes_used = 1;
  int transfers = 0;
  double predicted_makespan = 0;
  double measured_makespan = 0;
  // Planned again with the node times its first runs measured (the cost
  // model's per-node corrections; env TORCH_MGPU_REFINE=0 turns it off).
  bool refined = false;
  uint64_t graph_hash = 0;
};
LastPlan last_plan();

struct Simulation {
  double makespan = 0;       // predicted, seconds
  double lower_bound = 0;    // max(critical_path, total_work / lanes)
  double critical_path = 0;
  double total_work = 0;
  LastPlan plan;             // timeline holds predictions only
};
// Plans the pending graph for `devices` virtual devices with
// `lanes_per_device` lanes each, without running it.
Simulation simulate(int devices, int lanes_per_device = 1, const std::string& policy = "", int hosts = 1);

} // namespace torch_mgpu
