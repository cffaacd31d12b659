#pragma once
// Where work can run: devices, each with lanes (CUDA streams or CPU worker
// threads). What work and moving data cost there: cost_model.h.
#include "ir/graph.h"

#include <string>
#include <vector>

namespace torch_mgpu::plan {

struct Lane {
  int device = 0;  // index into Topology::devices
  int index = 0;   // lane number within the device
  std::string name;  // "cpu:0/lane1", "cuda:1/stream0", "rank1:cpu/lane0", "rank1:cuda:0/stream0"
  int rank = 0;      // the process that runs it: 0 this one, else a worker rank (runtime/remote.h)
};

struct Topology {
  std::vector<std::string> devices;  // "cpu", "cpu", "cuda:0", ...
  std::vector<Lane> lanes;
  int lanes_per_device = 1;
  int cores = 1;  // host cores shared by CPU lanes
  // The intra-op threads of the thread that syncs: a plan of one CPU lane
  // of this process runs with min(cores, caller_threads) (0: cores).
  int caller_threads = 0;
  bool cuda = false;
  bool remote = false;  // some device is another rank's ("rankN:cpu", "rankN:cuda:K": one lane each)
  // The network to the workers, measured at configure (0: not measured;
  // the cost model's figures stand).
  double link_latency_s = 0, link_bytes_per_s = 0;
  // Lanes on CPU devices share the host cores: this many threads each.
  int threads_per_lane(int lanes_in_use) const;
  // Threads of a plan that uses one lane only.
  int one_lane_threads() const;
};

// Parses {"cpu","cpu"} or {"cuda:0","cuda:1"}; `lanes_per_device` >= 1.
// "rankN:cpu" is the CPU of worker rank N (N >= 1) of the process group,
// "rankN:cuda:K" its CUDA device K: one lane, since a worker runs one node
// at a time. CPU and CUDA devices do not mix, across ranks either.
Topology make_topology(const std::vector<std::string>& devices, int lanes_per_device, int cores);
// K virtual devices of the same kind as `like`, S lanes each (simulation).
Topology virtual_topology(const Topology& like, int devices, int lanes_per_device);

} // namespace torch_mgpu::plan
