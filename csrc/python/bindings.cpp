// The Python binding: thin wrappers over the C++ API, no per-op logic.
#include <torch_mgpu/mgpu.h>

#include "capture/random.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Generator.h>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_mgpu: lazy multi-lane executor behind the mgpu device";
  m.def("synchronize", &torch_mgpu::synchronize, py::call_guard<py::gil_scoped_release>());
  m.def("pending_ops", &torch_mgpu::pending_ops);
  m.def("stats", &torch_mgpu::stats);
  m.def("max_pending_ops", &torch_mgpu::max_pending_ops);
  m.def("set_max_pending_ops", &torch_mgpu::set_max_pending_ops);
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
  m.def("_last_plan", [] {
    auto p = torch_mgpu::last_plan();
    py::dict d;
    if (!p.valid) return py::object(py::none());
    d["text"] = p.text;
    d["dot"] = p.dot;
    d["policy"] = p.policy;
    d["lanes"] = p.lanes;
    d["predicted_makespan"] = p.predicted_makespan;
    d["measured_makespan"] = p.measured_makespan;
    d["graph_hash"] = p.graph_hash;
    py::list tl;
    for (const auto& e : p.timeline) {
      py::dict x;
      x["node"] = e.node;
      x["op"] = e.op;
      x["lane"] = e.lane;
      x["start"] = e.start;
      x["end"] = e.end;
      tl.append(x);
    }
    d["timeline"] = tl;
    return py::object(d);
  });
}
