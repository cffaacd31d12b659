#include "runtime/replay.h"

#include "runtime/run_node.h"

#include <set>

namespace torch_mgpu::runtime {

namespace {
std::string mib(size_t bytes) {
  return std::to_string((bytes + (size_t(1) << 20) - 1) >> 20) + " MiB";
}
} // namespace

std::optional<std::string> replay_blocker(const ir::Graph& g, const plan::Plan& p, const std::vector<Place>& places,
                                          const ReplayLimits& limits) {
  if (g.nodes.empty()) return "no op to run";
  const std::set<int> lanes(p.lane_of.begin(), p.lane_of.end());
  std::optional<c10::Device> device;
  for (int l : lanes) {
    const Place& place = places.at(static_cast<size_t>(l));
    if (place.is_remote()) return "lane " + std::to_string(l) + " is on another process";
    if (!place.on_stream()) return "lane " + std::to_string(l) + " is a host lane (" + place.device.str() + "): only stream lanes are captured";
    if (device && *device != place.device)
      return "the lanes are on more than one device (" + device->str() + ", " + place.device.str() + ")";
    device = place.device;
  }
  size_t made = 0;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const ir::Node& n = *g.nodes[i];
    const Place& place = places[static_cast<size_t>(p.lane_of[i])];
    if (!runs_on(n, place))
      return describe_node(n) + " has no kernel for " + place.device.str() + ": it would run on the host";
    if (n.seed) return describe_node(n) + " draws random numbers: a replay would draw the same ones again";
    for (const auto& o : n.outputs) made += o.nbytes;
  }
  if (made > limits.pool_bytes)
    return "its values need " + mib(made) + ", more than a graph's pool holds (" + mib(limits.pool_bytes) + ")";
  return std::nullopt;
}

} // namespace torch_mgpu::runtime
