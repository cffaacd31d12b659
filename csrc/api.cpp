#include <torch_mgpu/mgpu.h>

#include <c10/core/DeviceType.h>

#include "capture/lazy_tensor.h"
#include "engine/at_call.h"
#include "engine/engine.h"
#include "ir/node.h"
#include "runtime/host_cache.h"
#include "runtime/counters.h"
#include "runtime/remote.h"

namespace torch_mgpu {

void init() {
  // The static registration ran when the library loaded; this checks it.
  TORCH_CHECK(c10::get_privateuse1_backend() == "mgpu", "torch_mgpu: the PrivateUse1 backend is already named '",
              c10::get_privateuse1_backend(), "'; another PrivateUse1 backend was loaded first");
}

void synchronize() {
  engine::at_call::ProgramRead read;
  engine::sync_all();
}

int64_t pending_ops() { return ir::pending_op_count(); }

std::map<std::string, int64_t> stats() {
  auto& c = runtime::counters();
  const auto host = runtime::host_cache_stats();  // one snapshot, one lock
  std::map<std::string, int64_t> out = {
#define TORCH_MGPU_COUNTER_ENTRY(name) {#name, c.name.load()},
      TORCH_MGPU_COUNTERS(TORCH_MGPU_COUNTER_ENTRY)
#undef TORCH_MGPU_COUNTER_ENTRY
      {"pending_ops", ir::pending_op_count()},
      {"host_cache_bytes", host.cached_bytes},
      {"host_cache_hits", host.hits},
  };
  return out;
}

void empty_cache() { runtime::host_cache_empty(); }

int64_t max_pending_ops() { return engine::max_pending_ops(); }
void set_max_pending_ops(int64_t n) { engine::set_max_pending_ops(n); }
int64_t async_ops() { return engine::async_ops(); }
void set_async_ops(int64_t n) { engine::set_async_ops(n); }
void wait_for_flight() { engine::wait_for_flight(); }

c10::Device device(int index) {
  capture::check_device_index(static_cast<c10::DeviceIndex>(index));
  return {c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(index)};
}

namespace engine {
std::vector<TimelineEntry> timeline_of(const PlanRecord& rec) {
  std::vector<TimelineEntry> out;
  out.reserve(rec.graph.names.size());
  for (size_t i = 0; i < rec.graph.names.size(); ++i) {
    TimelineEntry e{static_cast<int>(i), std::string(rec.graph.names[i]), rec.lane_names[rec.lane_of[i]], 0, 0, 0, 0};
    if (i < rec.timing.size()) {
      e.start = rec.timing[i].start;
      e.end = rec.timing[i].end;
      e.threads = rec.timing[i].threads;
    }
    if (i < rec.fused.size()) e.fused = rec.fused[i];
    if (i < rec.predicted_start.size()) {
      e.predicted_start = rec.predicted_start[i];
      e.predicted_end = rec.predicted_end[i];
    }
    out.push_back(std::move(e));
  }
  return out;
}
} // namespace engine

namespace {
LastPlan to_public(const std::shared_ptr<const engine::PlanRecord>& rec) {
  LastPlan out;
  if (!rec) return out;
  out.valid = true;
  out.text = ir::to_text(rec->graph);
  out.dot = ir::to_dot(rec->graph, rec->lane_of);
  out.policy = rec->policy;
  out.lanes = rec->lane_names;
  out.lanes_used = rec->lanes_used;
  out.transfers = rec->transfers;
  out.predicted_makespan = rec->predicted_makespan;
  out.measured_makespan = rec->measured_makespan;
  out.refined = rec->refined;
  out.graph_hash = rec->graph_hash;
  out.timeline = engine::timeline_of(*rec);
  return out;
}
} // namespace

LastPlan last_plan() { return to_public(engine::last_plan()); }

void configure(const std::vector<std::string>& devices, int lanes_per_device, const std::string& policy) {
  engine::configure(devices, lanes_per_device, policy);
}

std::vector<std::string> lanes() { return engine::lane_names(); }

void set_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) { runtime::set_process_group(pg); }

bool serve_as_worker(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  std::string why;
  const bool released = runtime::serve(pg, &why);
  if (!released) TORCH_WARN("torch_mgpu worker (rank ", pg->getRank(), "): ", why);
  return released;
}

void release_workers() { runtime::release_workers(); }

std::string policy() { return engine::policy(); }

Simulation simulate(int devices, int lanes_per_device, const std::string& policy, int hosts) {
  auto s = engine::simulate(devices, lanes_per_device, policy, "", hosts);
  Simulation out;
  out.makespan = s.makespan;
  out.lower_bound = s.lower_bound;
  out.critical_path = s.critical_path;
  out.total_work = s.total_work;
  out.plan = to_public(s.plan);
  return out;
}

} // namespace torch_mgpu
