// Reports: the record of the last plan run, and simulate(),
// which plans the pending graph for other lanes and runs nothing.
#include "engine/report.h"
#include "engine/config.h"
#include "engine/plan_cache.h"
#include "capture/state_lock.h"
#include "runtime/counters.h"
#include "runtime/replay.h"

#include <algorithm>

namespace torch_mgpu {
namespace engine {
namespace {

std::shared_ptr<const PlanRecord>& last_plan_slot() {
  static auto* p = new std::shared_ptr<const PlanRecord>();
  return *p;
}

} // namespace

std::shared_ptr<PlanRecord> describe(const ir::Graph& g, const plan::Plan& p, const runtime::ExecResult* r) {
  auto rec = std::make_shared<PlanRecord>();
  rec->graph = ir::summarize(g);
  for (const auto& l : p.lanes) rec->lane_names.push_back(l.name);
  rec->lane_of = p.lane_of;
  if (r) {
    rec->timing = r->timing;
    rec->measured_makespan = r->makespan;
    rec->remote_bytes_sent = r->remote_bytes_sent;
    rec->remote_bytes_received = r->remote_bytes_received;
    rec->remote_bytes_between_workers = r->remote_bytes_between_workers;
  }
  rec->fused = p.fusion.group_of;
  rec->predicted_start = p.predicted_start;
  rec->predicted_end = p.predicted_end;
  rec->policy = p.policy;
  rec->lanes_used = p.lanes_used;
  rec->transfers = p.transfers;
  rec->predicted_makespan = p.predicted_makespan;
  rec->refined = p.refined;
  rec->graph_hash = g.hash;
  return rec;
}

void set_last_plan(std::shared_ptr<const PlanRecord> record) { last_plan_slot() = std::move(record); }

std::shared_ptr<const PlanRecord> last_plan() {
  capture::StateLock lock;
  return last_plan_slot();
}

Simulation simulate(int devices, int lanes_per_device, const std::string& policy, const std::string& device,
                    int hosts) {
  capture::StateLock lock;
  auto lanes = current_lanes();
  TORCH_CHECK(lanes_per_device >= 1, "torch_mgpu.simulate: lanes_per_device must be >= 1, got ", lanes_per_device);
  TORCH_CHECK(devices >= 1, "torch_mgpu.simulate: devices must be >= 1, got ", devices);
  TORCH_CHECK(hosts >= 1, "torch_mgpu.simulate: hosts must be >= 1, got ", hosts);
  plan::Topology topo;
  plan::CostModel gpu;
  if (!device.empty()) {
    gpu = plan::gpu_cost_model(plan::device_profile(device));
    std::vector<std::string> names;
    for (int d = 0; d < devices; ++d) names.push_back("cuda:" + std::to_string(d));
    // Each other host: a worker rank with one GPU of the same profile.
    for (int h = 1; h < hosts; ++h) names.push_back("rank" + std::to_string(h) + ":cuda:0");
    topo = plan::make_topology(names, lanes_per_device, host_cores());
    // The network measured at configure, if any (else the model's figures).
    gpu = plan::with_link(gpu, lanes->topo);
  } else {
    topo = plan::virtual_topology(lanes->topo, devices, lanes_per_device);
    if (hosts > 1) {
      // Each other host: a worker rank, one lane over the network measured
      // at configure (cost_model() carries it; else the model's figures).
      auto names = topo.devices;
      for (int h = 1; h < hosts; ++h) names.push_back("rank" + std::to_string(h) + ":cpu");
      const auto cores = topo.cores;
      topo = plan::make_topology(names, lanes_per_device, cores);
    }
  }
  // Planned as a sync from this thread would plan it (one lane runs with
  // this thread's intra-op threads).
  if (device.empty()) topo = for_caller(topo, runtime::thread_parallelism());
  ir::Graph g = ir::build_graph(pending_roots());
  const plan::CostModel cm = device.empty() ? cost_model() : gpu;  // with the configured network's figures
  const std::string& pol = policy.empty() ? lanes->policy : policy;
  // The plan a sync would run: for lanes like the current ones, the cached
  // plan of this graph if there is one (refined by its measured runs); else
  // one made by the syncs' own planning (GPU profiles: stream lanes).
  std::shared_ptr<const plan::Plan> cached = device.empty() ? plan_if_cached(g, topo, pol) : nullptr;
  const bool streams = !device.empty() || stream_lanes(*lanes);
  const plan::Plan p = cached ? *cached : make_plan_for(g, topo, cm, pol, streams);
  auto e = plan::estimate(g, topo, cm);
  if (cm.sms == 0 && (p.refined || !p.fusion.groups.empty())) {
    // Fused runs and measured corrections change what a node costs: the
    // bounds then come from the plan's own node times.
    plan::bounds_from_plan(g, p, static_cast<int>(topo.lanes.size()), e);
  }
  Simulation s;
  s.makespan = p.predicted_makespan;
  s.lower_bound = e.lower_bound;
  s.critical_path = e.critical_path;
  s.total_work = e.total_work;
  s.plan = describe(g, p, nullptr);
  return s;
}

std::optional<std::string> replay_blocker_of_pending() {
  capture::StateLock lock;
  auto lanes = current_lanes();
  ir::Graph g = ir::build_graph(pending_roots());
  const auto p = plan_for(g, *lanes, runtime::thread_parallelism());
  return runtime::replay_blocker(g, *p, lanes->places);
}

} // namespace engine
} // namespace torch_mgpu
