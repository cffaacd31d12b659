#pragma once
// The cost model: what an op costs on a lane (rates per thread calibrated
// on the machine, overheads; or a GPU's published figures), the work of an
// op from its name and argument geometries (a GEMM's flops, elementwise
// and transcendental outputs, bytes moved), and the seconds of work and of
// moving bytes between lanes. Plans (plan.h), tier 1's split (pieces.h) and
// torch.compile's partitioner price work here only.
#include "ir/graph.h"
#include "plan/topology.h"

#include <string>
#include <vector>

namespace torch_mgpu::plan {

// What an op costs on a lane: calibrated rates per thread, overheads.
struct CostModel {
  double gemm_flops_per_s = 2e10;      // one thread, large products
  double small_gemm_flops_per_s = 1e10; // one thread, products under ~2 MFLOP
  double elem_per_s = 1e9;             // elementwise outputs per second, one thread
  double transcendental_per_s = 2e8;   // tanh, exp, sigmoid, softmax... outputs per second
  double bytes_per_s = 8e9;            // memory traffic, one thread
  double op_overhead_s = 4e-6;         // running one node on a lane
  double lane_sync_s = 8e-6;           // a cross-lane dependency (event / wakeup)
  double launch_s = 30e-6;             // waking the lanes for a parallel plan
  double transfer_bytes_per_s = 6e9;   // between devices
  double transfer_latency_s = 10e-6;
  double parallel_min_flops = 2e6;     // below this an op runs on one thread
  double parallel_efficiency = 0.9;    // per extra thread, above that size
  // A compiled partition's call on a lane (its Python wrapper, the GIL)
  // and the wait for it: what cutting a graph in one more partition costs.
  double partition_call_s = 150e-6;
  // Lanes on other ranks: a value crossing ranks pays the network's latency
  // and bandwidth; a lane there starts when its program arrives (one
  // latency) and runs each node a little slower than a lane here (the
  // worker reads the node from its message).
  double network_latency_s = 100e-6;
  double network_bytes_per_s = 1e9;
  double remote_call_s = 5e-6;
  double fused_step_s = 6e-8;          // a step of a fused pointwise pass over one 1024-element block (in cache)
  bool calibrated = false;
  // A GPU: its streams share the device's SMs (a kernel fills part of the
  // device, device_fill below; kernels that together ask for more than the
  // whole device slow down in proportion). 0 for CPU lanes, which are
  // independent processors.
  int sms = 0;
  double peer_bytes_per_s = 0;  // between two GPUs (NVLink); 0: through the host at transfer_bytes_per_s
  std::string profile;          // the device profile it came from ("h100"); empty if none
};

// The figures of the model that Python reads and tests pin
// (torch_mgpu._C._cost_model, _pin_cost_model), by name: one list.
struct CostFigure {
  const char* name;
  double CostModel::*field;
};
const std::vector<CostFigure>& cost_figures();

// A GPU's published figures: what the model needs to plan for it without
// one. Rates are the dense FP32 ones (PyTorch's default for float32 matrix
// products, no TF32) and sustained bandwidths, not marketing peaks.
struct DeviceProfile {
  std::string name;                 // "h100"
  std::string description;
  int sms = 0;                      // streaming multiprocessors
  double fp32_flops_per_s = 0;      // dense FP32, sustained by large products
  double memory_bytes_per_s = 0;    // device memory, sustained
  double launch_s = 0;              // one kernel, queued back to back
  double host_bytes_per_s = 0;      // host <-> device (PCIe), one direction
  double peer_bytes_per_s = 0;      // device <-> device (NVLink), one direction; 0: none
  double memory_bytes = 0;
};
// Built-in profiles ("v100", "a100", "h100", "h200", "l4").
const std::vector<DeviceProfile>& device_profiles();
// The profile named `name` (case-insensitive); raises listing the known ones.
const DeviceProfile& device_profile(const std::string& name);
// The cost model of a GPU with `d`'s figures.
CostModel gpu_cost_model(const DeviceProfile& d);

struct Work {
  double flops = 0;   // multiply-adds count 2
  double bytes = 0;   // read + written
  bool gemm = false;  // runs at GEMM rates
  bool transcendental = false;  // tanh, exp, ...: slower per element
  bool fused = false;  // a later step of a fused pointwise pass: no call of its own, its block in cache
  // Compiled partitions mix kinds of work: besides `flops` (at the GEMM
  // rate when `gemm`), elementwise and transcendental outputs.
  double elem = 0, transcendental_elems = 0;
  double out_elems = 0;  // elements of its largest output: how much of a GPU it can fill
  // Intra-op threads its elementwise loops were compiled for (0: any).
  int loop_threads = 0;
  // Measured over modelled time of this node in earlier runs of the same
  // graph (1: not measured): corrects what the model cannot know, such as
  // an op's speed on this data or a kernel the model has no formula for.
  double scale = 1.0;
};

// A node's work, from its op name and argument geometries.
Work estimate_work(const ir::Node& n);
// The work of an op of another compiler's graph (torch.compile's ATen
// graphs, before they are cut into partitions), by the same rules: its
// schema, its arguments (tensor geometries and constants) and its results.
// A view (a result that aliases an argument it does not write) is no work.
Work estimate_op_work(const c10::FunctionSchema& schema, c10::ArrayRef<ir::Arg> args,
                      c10::ArrayRef<ir::Output> outputs);
// The work of a compiled partition (or a piece of one) with these figures:
// GEMM flops, elementwise and transcendental outputs, bytes moved.
Work partition_work(double gemm_flops, double elem, double transcendental, double bytes);
// The share of a GPU (cm.sms > 0) that `w`'s kernel occupies when it runs
// alone, in (0, 1]: its thread blocks against what the SMs hold at once (a
// 128x128 output tile per block for products, about one such block per SM;
// 512 elements per block for other kernels, 16 blocks per SM). 1 on CPU.
double device_fill(const Work& w, const CostModel& cm);
// Seconds for `w` on a lane running `threads` intra-op threads (on a GPU:
// alone on the device, at its fill's share of the device's rates).
double node_seconds(const Work& w, const CostModel& cm, int threads);
// The part of node_seconds that is the host's (launching it), not the device's.
double launch_seconds(const Work& w, const CostModel& cm);
// Seconds to move `bytes` from lane a to lane b (0 on the same lane).
// Between ranks: the network's.
double edge_seconds(double bytes, const Lane& a, const Lane& b, const CostModel& cm);
// What running one node on `lane` adds to its work (0 on this process's lanes).
inline double call_seconds(const Lane& lane, const CostModel& cm) { return lane.rank ? cm.remote_call_s : 0.0; }
// `cm` with the network figures `t` measured (if any).
CostModel with_link(CostModel cm, const Topology& t);

} // namespace torch_mgpu::plan
