// The simulator: a plan's predicted timeline (each node's start and end on
// its lane, transfers between devices, a GPU's streams sharing its SMs).
#include "plan/plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <map>
#include <queue>
#include <unordered_map>

namespace torch_mgpu::plan {

void simulate(const ir::Graph& g, const Topology& t, const CostModel& cm, Plan& p) {
  std::vector<Work> work(g.size());
  for (size_t i = 0; i < g.size(); ++i) work[i] = estimate_work(*g.nodes[i]);
  simulate(g, t, cm, work, p);
}

namespace {
// GPU lanes: the streams of a device share it. Each lane runs its nodes in
// order; a node is launched (launch_seconds: the host's part, not shared)
// once its lane is free and its inputs have arrived, then its kernel's work
// (seconds alone on the device) advances at min(1, 1 / the summed fill of
// the kernels running on that device at the time).
void simulate_shared(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work,
                     const std::vector<double>& bytes_of, Plan& p) {
  const size_t n = g.size();
  const size_t lanes = p.lane_order.size();
  std::vector<double> fill(n), launch(n), rest(n);
  for (size_t i = 0; i < n; ++i) {
    fill[i] = device_fill(work[i], cm);
    launch[i] = launch_seconds(work[i], cm);
    rest[i] = std::max(0.0, node_seconds(work[i], cm, 1) - launch[i]);
  }
  enum class Phase { Idle, Launching, Running };
  std::vector<size_t> head(lanes, 0);
  std::vector<int> current(lanes, -1);
  std::vector<Phase> phase(lanes, Phase::Idle);
  std::vector<double> launched_at(lanes, 0.0);
  std::vector<double> lane_free(lanes, p.lanes_used > 1 ? cm.launch_s : 0.0);
  std::vector<bool> done(n, false);
  std::vector<double> load(t.devices.size(), 0.0);
  size_t remaining = n;
  double now = 0, makespan = 0;
  constexpr double eps = 1e-15;
  while (remaining) {
    for (size_t l = 0; l < lanes; ++l) {
      if (current[l] >= 0 || head[l] >= p.lane_order[l].size()) continue;
      const int i = p.lane_order[l][head[l]];
      double start = std::max(now, lane_free[l]);
      bool ready = true;
      for (int d : g.deps[i]) {
        ready &= done[d];
        if (done[d])
          start = std::max(start, p.predicted_end[d] + edge_seconds(bytes_of[d], p.lanes[p.lane_of[d]], p.lanes[l], cm));
      }
      if (!ready) continue;
      current[l] = i;
      phase[l] = Phase::Launching;
      p.predicted_start[i] = start;
      launched_at[l] = start + launch[i];
    }
    std::fill(load.begin(), load.end(), 0.0);
    for (size_t l = 0; l < lanes; ++l)
      if (phase[l] == Phase::Running) load[p.lanes[l].device] += fill[current[l]];
    auto speed = [&](size_t l) { return std::min(1.0, 1.0 / std::max(load[p.lanes[l].device], eps)); };
    double next = std::numeric_limits<double>::infinity();
    for (size_t l = 0; l < lanes; ++l) {
      if (phase[l] == Phase::Launching) next = std::min(next, launched_at[l]);
      if (phase[l] == Phase::Running) next = std::min(next, now + rest[current[l]] / speed(l));
    }
    TORCH_INTERNAL_ASSERT(next < std::numeric_limits<double>::infinity(),
                          "torch_mgpu: plan order deadlocks (lane orders contradict dependencies)");
    for (size_t l = 0; l < lanes; ++l)
      if (phase[l] == Phase::Running) rest[current[l]] -= (next - now) * speed(l);
    now = next;
    for (size_t l = 0; l < lanes; ++l) {
      if (phase[l] == Phase::Launching && launched_at[l] <= now + eps) phase[l] = Phase::Running;
      if (phase[l] == Phase::Running && rest[current[l]] <= 1e-12 * (1.0 + now)) {
        const int i = current[l];
        p.predicted_end[i] = now;
        makespan = std::max(makespan, now);
        done[i] = true;
        --remaining;
        lane_free[l] = now;
        current[l] = -1;
        phase[l] = Phase::Idle;
        ++head[l];
      }
    }
  }
  p.predicted_makespan = makespan;
}
} // namespace

void simulate(const ir::Graph& g, const Topology& t, const CostModel& cm, const std::vector<Work>& work, Plan& p) {
  const size_t n = g.size();
  p.predicted_start.assign(n, 0.0);
  p.predicted_end.assign(n, 0.0);
  std::vector<double> bytes_of(n, 0.0);
  for (size_t i = 0; i < n; ++i)
    for (const auto& o : g.nodes[i]->outputs) bytes_of[i] += static_cast<double>(o.nbytes);
  if (cm.sms > 0) {
    simulate_shared(g, t, cm, work, bytes_of, p);
    return;
  }
  // Lanes advance in their order; a node waits for its inputs. Process nodes
  // in an order consistent with both (a topological order that respects each
  // lane's sequence): repeatedly take the lane head whose deps are done.
  std::vector<size_t> head(p.lane_order.size(), 0);
  std::vector<double> lane_free(p.lane_order.size(), p.lanes_used > 1 ? cm.launch_s : 0.0);
  for (size_t l = 0; l < p.lane_order.size(); ++l)
    if (p.lanes[l].rank) lane_free[l] += cm.network_latency_s;  // its program's way there
  std::vector<bool> done(n, false);
  size_t remaining = n;
  double makespan = 0;
  while (remaining) {
    bool progressed = false;
    for (size_t l = 0; l < p.lane_order.size(); ++l) {
      while (head[l] < p.lane_order[l].size()) {
        int i = p.lane_order[l][head[l]];
        bool ready = true;
        for (int d : g.deps[i]) ready &= done[d];
        if (!ready) break;
        double start = lane_free[l];
        for (int d : g.deps[i])
          start = std::max(start, p.predicted_end[d] + edge_seconds(bytes_of[d], p.lanes[p.lane_of[d]], p.lanes[l], cm));
        double end = start + node_seconds(work[i], cm, p.threads_per_lane) + call_seconds(p.lanes[l], cm);
        p.predicted_start[i] = start;
        p.predicted_end[i] = end;
        lane_free[l] = end;
        makespan = std::max(makespan, end);
        done[i] = true;
        --remaining;
        ++head[l];
        progressed = true;
      }
    }
    TORCH_INTERNAL_ASSERT(progressed, "torch_mgpu: plan order deadlocks (lane orders contradict dependencies)");
  }
  p.predicted_makespan = makespan;
}

} // namespace torch_mgpu::plan
