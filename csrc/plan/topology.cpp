#include "plan/topology.h"
#include "ir/partition.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cmath>

namespace torch_mgpu::plan {

int Topology::threads_per_lane(int lanes_in_use) const {
  if (cuda) return 1;
  return std::max(1, cores / std::max(1, lanes_in_use));
}

int Topology::one_lane_threads() const {
  return cuda || caller_threads <= 0 ? cores : std::min(cores, caller_threads);
}

Topology make_topology(const std::vector<std::string>& devices, int lanes_per_device, int cores) {
  TORCH_CHECK(!devices.empty(), "torch_mgpu: at least one device is needed");
  TORCH_CHECK(lanes_per_device >= 1, "torch_mgpu: lanes_per_device must be >= 1, got ", lanes_per_device);
  Topology t;
  t.devices = devices;
  t.lanes_per_device = lanes_per_device;
  t.cores = std::max(1, cores);
  bool any_cuda = false, any_cpu = false;
  for (size_t d = 0; d < devices.size(); ++d) {
    const auto& s = devices[d];
    int rank = 0;
    std::string local = s;
    if (s.rfind("rank", 0) == 0) {
      const size_t colon = s.find(':');
      const std::string digits = s.substr(4, colon == std::string::npos ? std::string::npos : colon - 4);
      TORCH_CHECK(colon != std::string::npos && !digits.empty() && digits.size() < 9 &&
                      digits.find_first_not_of("0123456789") == std::string::npos,
                  "torch_mgpu: unknown device '", s, "' (a remote device is 'rankN:cpu' or 'rankN:cuda:K')");
      rank = std::stoi(digits);
      local = s.substr(colon + 1);
      TORCH_CHECK(local == "cpu" || local.rfind("cuda:", 0) == 0, "torch_mgpu: unknown device '", s,
                  "' (a remote device is 'rank", rank, ":cpu' or 'rank", rank, ":cuda:K')");
      TORCH_CHECK(rank >= 1, "torch_mgpu: 'rank0' is this process: name its devices without a rank ('cpu')");
      for (const auto& lane : t.lanes)
        TORCH_CHECK(lane.rank != rank, "torch_mgpu: rank ", rank, " is named twice (a worker rank is one device)");
    }
    bool is_cuda = local.size() > 5 && local.rfind("cuda:", 0) == 0 &&
        local.find_first_not_of("0123456789", 5) == std::string::npos;
    TORCH_CHECK(is_cuda || local == "cpu" || local.rfind("cpu:", 0) == 0,
                "torch_mgpu: unknown device '", s, "' (expected 'cpu', 'cuda:N', 'rankN:cpu' or 'rankN:cuda:K')");
    any_cuda |= is_cuda;
    any_cpu |= !is_cuda;
    t.remote |= rank > 0;
    const int lanes = rank > 0 ? 1 : lanes_per_device;
    for (int l = 0; l < lanes; ++l) {
      Lane lane;
      lane.device = static_cast<int>(d);
      lane.index = l;
      lane.rank = rank;
      lane.name = (rank > 0 || is_cuda ? s : "cpu:" + std::to_string(d)) + (is_cuda ? "/stream" : "/lane") +
          std::to_string(l);
      t.lanes.push_back(lane);
    }
  }
  TORCH_CHECK(!(any_cuda && any_cpu), "torch_mgpu: mixing CPU and CUDA devices is not supported");
  t.cuda = any_cuda;
  return t;
}

Topology virtual_topology(const Topology& like, int devices, int lanes_per_device) {
  TORCH_CHECK(devices >= 1, "torch_mgpu.simulate: devices must be >= 1, got ", devices);
  std::vector<std::string> names;
  for (int d = 0; d < devices; ++d) names.push_back(like.cuda ? "cuda:" + std::to_string(d) : "cpu");
  // Virtual GPUs do not share host cores: give each CPU lane its own.
  int cores = like.cuda ? like.cores : std::max(like.cores, devices * lanes_per_device);
  return make_topology(names, lanes_per_device, cores);
}

} // namespace torch_mgpu::plan
