#pragma once
// The lanes configured now and the plans made for them (internal to engine/).
#include "ir/lru.h"
#include "ir/trial.h"
#include "engine/execution.h"

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch_mgpu::engine {

constexpr int kRefineRuns = 3;

// A cached plan, and what its first runs measured: after the first run
// (cold: first touches of memory) kRefineRuns runs record each node's
// measured / predicted time; then the graph is planned again, once, with
// each node's median ratio as its Work::scale, if any node was off by more
// than kRefineOff. Later runs keep that plan (no flip-flop under noise),
// except that a plan with lanes on other ranks is then measured against one
// lane (below).
struct CachedPlan {
  std::shared_ptr<const plan::Plan> plan;
  const Lanes* lanes = nullptr;  // what it was planned for (the cache is emptied when they change)
  std::vector<std::vector<double>> ratios;  // per node, one per measured run
  int runs = 0;
  bool refined = false;  // the ratios are in (and the plan remade if off)
  bool settled = false;  // nothing more to learn
  // A plan with lanes on other ranks, once refined, runs kRefineRuns more
  // times, then one lane (`trial`, planned with `scale`) as many: the
  // faster is kept. `kept`: the plan while the trial runs.
  std::vector<double> scale;
  ir::Trial times = one_lane_trial();  // way 0 the plan, way 1 one lane
  static ir::Trial one_lane_trial() { return ir::Trial(2, static_cast<size_t>(kRefineRuns), ir::margin::kOneLane); }
  std::shared_ptr<const plan::Plan> trial, kept;
};

// Lanes (and their places), the policy and the plan cache.
// Locking: `m` guards the pointer `lanes` and `plans`; a Lanes never
// changes once made (configure() swaps in a new one), so an execution reads
// the one it started with, with no lock. Only configure() writes `lanes`,
// under the state lock and with no flight running.
struct Config {
  std::mutex m;
  std::shared_ptr<const Lanes> lanes;
  ir::Lru<uint64_t, CachedPlan> plans{1024};  // by graph hash (and caller's threads: plan_key)
  Config();  // from TORCH_MGPU_DEVICES / _LANES / _POLICY, or every visible GPU, or the CPU
  static int default_lanes(const std::vector<std::string>& devices);
  // A topology for `devices`, refused (with a clear error) if this machine lacks them.
  static plan::Topology checked_topology(const std::vector<std::string>& devices, int lanes);
  static std::shared_ptr<const Lanes> make_lanes(plan::Topology t, std::string policy);
};
Config& config();

int host_cores();

} // namespace torch_mgpu::engine
