// The Python binding: thin wrappers over the C++ API, no per-op logic.
#include <torch_mgpu/mgpu.h>

#include "capture/random.h"
#include "engine/engine.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Generator.h>

namespace py = pybind11;

namespace {
py::object plan_dict(const torch_mgpu::LastPlan& p) {
  if (!p.valid) return py::none();
  py::dict d;
  d["text"] = p.text;
  d["dot"] = p.dot;
  d["policy"] = p.policy;
  d["lanes"] = p.lanes;
  d["lanes_used"] = p.lanes_used;
  d["transfers"] = p.transfers;
  d["predicted_makespan"] = p.predicted_makespan;
  d["measured_makespan"] = p.measured_makespan;
  d["refined"] = p.refined;
  d["graph_hash"] = p.graph_hash;
  py::list tl;
  for (const auto& e : p.timeline) {
    py::dict x;
    x["node"] = e.node;
    x["op"] = e.op;
    x["lane"] = e.lane;
    x["start"] = e.start;
    x["end"] = e.end;
    x["predicted_start"] = e.predicted_start;
    x["predicted_end"] = e.predicted_end;
    x["fused"] = e.fused;
    x["threads"] = e.threads;
    tl.append(x);
  }
  d["timeline"] = tl;
  return d;
}
} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_mgpu: lazy multi-lane executor behind the mgpu device";
  m.def("synchronize", &torch_mgpu::synchronize, py::call_guard<py::gil_scoped_release>());
  m.def("pending_ops", &torch_mgpu::pending_ops);
  m.def("stats", &torch_mgpu::stats);
  m.def("empty_cache", &torch_mgpu::empty_cache);
  m.def("max_pending_ops", &torch_mgpu::max_pending_ops);
  m.def("set_max_pending_ops", &torch_mgpu::set_max_pending_ops);
  m.def("async_ops", &torch_mgpu::async_ops);
  m.def("set_async_ops", &torch_mgpu::set_async_ops);
  m.def("device_count", [] { return 1; });
  m.def("default_generator", [](int index) {
    return py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(torch_mgpu::capture::default_generator(index)));
  });
  m.def("manual_seed_all", [](uint64_t seed) {
    auto gen = torch_mgpu::capture::default_generator(0);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  });
  m.def("configure", &torch_mgpu::configure, py::arg("devices"), py::arg("lanes_per_device"), py::arg("policy"),
        py::call_guard<py::gil_scoped_release>());
  m.def("lanes", &torch_mgpu::lanes);
  m.def("policy", [] { return torch_mgpu::policy(); });
  m.def("_last_plan", [] { return plan_dict(torch_mgpu::last_plan()); });
  m.def("_cost_model", [] {
    const auto& cm = torch_mgpu::engine::cost_model();
    py::dict d;
    d["gemm_flops_per_s"] = cm.gemm_flops_per_s;
    d["small_gemm_flops_per_s"] = cm.small_gemm_flops_per_s;
    d["elem_per_s"] = cm.elem_per_s;
    d["transcendental_per_s"] = cm.transcendental_per_s;
    d["bytes_per_s"] = cm.bytes_per_s;
    d["op_overhead_s"] = cm.op_overhead_s;
    d["lane_sync_s"] = cm.lane_sync_s;
    d["launch_s"] = cm.launch_s;
    d["transfer_bytes_per_s"] = cm.transfer_bytes_per_s;
    d["parallel_min_flops"] = cm.parallel_min_flops;
    d["parallel_efficiency"] = cm.parallel_efficiency;
    d["calibrated"] = cm.calibrated;
    return d;
  });
  m.def("_simulate", [](int devices, int lanes, const std::string& policy) {
    torch_mgpu::Simulation s;
    {
      py::gil_scoped_release nogil;
      s = torch_mgpu::simulate(devices, lanes, policy);
    }
    py::dict d;
    d["makespan"] = s.makespan;
    d["lower_bound"] = s.lower_bound;
    d["critical_path"] = s.critical_path;
    d["total_work"] = s.total_work;
    d["plan"] = plan_dict(s.plan);
    return d;
  });
}
