// The Python binding: thin wrappers over the C++ API, no per-op logic.
#include <torch_mgpu/mgpu.h>

#include "backend/backend.h"
#include "capture/capture.h"
#include "capture/lazy_tensor.h"
#include "capture/random.h"
#include "capture/state_lock.h"
#include "engine/engine.h"
#include "ir/env.h"
#include "ir/partition.h"
#include "ir/trial.h"
#include "python/caller.h"
#include "python/tiers.h"
#include "runtime/faults.h"
#include "runtime/sanitizer.h"
#include "runtime/lanes.h"

#include <algorithm>
#include <map>

#include <ATen/native/Resize.h>
#include <ATen/ops/_resize_output.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace {
// A plan record, read by torch_mgpu.Plan on demand: last_plan() costs no
// text, graphviz or per-node objects until they are asked for (building
// them all for a 1000-node plan took a millisecond).
struct PlanHandle {
  std::shared_ptr<const torch_mgpu::engine::PlanRecord> rec;
};

py::object plan_handle(std::shared_ptr<const torch_mgpu::engine::PlanRecord> rec) {
  if (!rec) return py::none();
  return py::cast(PlanHandle{std::move(rec)});
}

py::dict plan_summary(const PlanHandle& h) {
  const auto& r = *h.rec;
  py::dict d;
  d["policy"] = r.policy;
  d["lanes"] = r.lane_names;
  d["lanes_used"] = r.lanes_used;
  d["transfers"] = r.transfers;
  d["remote_bytes_sent"] = r.remote_bytes_sent;
  d["remote_bytes_received"] = r.remote_bytes_received;
  d["remote_bytes_between_workers"] = r.remote_bytes_between_workers;
  d["predicted_makespan"] = r.predicted_makespan;
  d["measured_makespan"] = r.measured_makespan;
  d["refined"] = r.refined;
  d["graph_hash"] = r.graph_hash;
  d["tier"] = r.tier;
  d["compiled"] = r.compiled;
  d["replay"] = r.replay;
  d["nodes"] = r.graph.names.size();
  d["fused_nodes"] = std::count_if(r.fused.begin(), r.fused.end(), [](int g) { return g >= 0; });
  return d;
}

// Python's GIL, for the engine: taking its state lock lets go of the GIL
// first (capture/state_lock.h), so that no thread ever waits for the state
// lock while holding the GIL.
// This thread holds the GIL when the thread state running Python now is its
// own (PyGILState_Check answers 1 for every thread once a subinterpreter
// exists; before 3.12 the running thread state is process-wide).
bool gil_held() {
  if (!Py_IsInitialized()) return false;
  PyThreadState* mine = PyGILState_GetThisThreadState();
  return mine != nullptr && mine == py::detail::get_thread_state_unchecked();
}
void* gil_release() { return PyEval_SaveThread(); }
void gil_restore(void* state) { PyEval_RestoreThread(static_cast<PyThreadState*>(state)); }
// KeyboardInterrupt or SystemExit, as a Python kernel's error reaches C++
// (pybind11's error_already_set, or torch's python_error, whose exception
// may still be this thread's pending one).
bool python_interrupt(const std::exception& e) {
  const auto stops = [](PyObject* type) {
    return type && (PyErr_GivenExceptionMatches(type, PyExc_KeyboardInterrupt) ||
                    PyErr_GivenExceptionMatches(type, PyExc_SystemExit));
  };
  if (!Py_IsInitialized()) return false;
  if (const auto* pe = dynamic_cast<const py::error_already_set*>(&e)) {
    py::gil_scoped_acquire gil;
    return stops(pe->type().ptr());
  }
  if (const auto* pe = dynamic_cast<const python_error*>(&e)) {
    py::gil_scoped_acquire gil;
    if (pe->type) return stops(pe->type);
    return stops(PyErr_Occurred());
  }
  return false;
}

// A Python kernel's error the caller handles (by a rerun on the CPU): a
// python_error that left its exception pending on this thread clears it.
void python_error_handled(const std::exception& e) {
  if (!Py_IsInitialized()) return;
  if (const auto* pe = dynamic_cast<const python_error*>(&e)) {
    if (pe->type) return;
    py::gil_scoped_acquire gil;
    PyErr_Clear();
  }
}

py::list plan_timeline(const PlanHandle& h) {
  py::list tl;
  for (const auto& e : torch_mgpu::engine::timeline_of(*h.rec)) {
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
  return tl;
}
// A compiled partition, as Python holds it.
struct PartitionHandle {
  c10::intrusive_ptr<torch_mgpu::ir::Partition> p;
};

} // namespace

// The partition's code: a Python callable taking a list of tensors and
// returning a sequence of them, called with the GIL from any lane thread
// (inductor's C++ wrapper lets go of it inside). Python errors become C++
// errors with their message here, while the GIL is held.
namespace torch_mgpu::python {
namespace {
// A Python error of compiled code as the C++ error torch raises it back as:
// its class kept for torch's own (LinAlgError, IndexError, ValueError,
// TypeError, NotImplementedError), RuntimeError with its text otherwise.
[[noreturn]] void rethrow_as_cpp(const py::error_already_set& e) {
  // An interrupt stays Python's (ir::is_interrupt knows it, and no
  // fallback takes it for the code's error).
  if (python_interrupt(e)) throw;
  static PyObject* const linalg_error = py::object(py::module_::import("torch.linalg").attr("LinAlgError")).release().ptr();
  PyObject* type = e.type().ptr();
  const std::string msg = py::str(e.value());
  TORCH_CHECK_LINALG(!PyErr_GivenExceptionMatches(type, linalg_error), msg);
  TORCH_CHECK_NOT_IMPLEMENTED(!PyErr_GivenExceptionMatches(type, PyExc_NotImplementedError), msg);
  TORCH_CHECK_INDEX(!PyErr_GivenExceptionMatches(type, PyExc_IndexError), msg);
  TORCH_CHECK_VALUE(!PyErr_GivenExceptionMatches(type, PyExc_ValueError), msg);
  TORCH_CHECK_TYPE(!PyErr_GivenExceptionMatches(type, PyExc_TypeError), msg);
  TORCH_CHECK(false, e.what());
}
} // namespace

ir::Partition::Fn tensors_fn(py::function fn) {
  std::shared_ptr<py::function> held(new py::function(std::move(fn)), [](py::function* f) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete f;
    } else {
      f->release();  // the interpreter is gone: nothing to give back
      delete f;
    }
  });
  return [held](const std::vector<at::Tensor>& inputs) {
    // A thread that takes the GIL while the interpreter shuts down is ended
    // there (or waits for ever): the caller runs the graph without it.
    TORCH_CHECK(!Py_IsFinalizing(), "mgpu: the interpreter is shutting down: compiled code is not called");
    py::gil_scoped_acquire gil;
    try {
      py::list args;
      for (const auto& t : inputs) args.append(py::cast(t));
      py::object r = (*held)(args);
      std::vector<at::Tensor> out;
      for (auto h : r) out.push_back(h.cast<at::Tensor>());
      return out;
    } catch (py::error_already_set& e) {
      rethrow_as_cpp(e);
    }
  };
}
} // namespace torch_mgpu::python

namespace {
torch_mgpu::ir::TensorGeometry geometry_of_spec(const at::Tensor& t) {
  torch_mgpu::ir::TensorGeometry g;
  g.dtype = t.scalar_type();
  g.sizes.assign(t.sizes().begin(), t.sizes().end());
  g.strides.assign(t.strides().begin(), t.strides().end());
  return g;
}

// An argument of an op of a torch.compile graph, for the cost model: a
// tensor (Meta is fine) or a list of them, an int or a list of ints, else
// nothing the model reads.
torch_mgpu::ir::Arg op_arg(const py::handle& v) {
  using torch_mgpu::ir::Arg;
  Arg a;
  auto tensor_ref = [](const py::handle& t) {
    return torch_mgpu::ir::TensorRef{0, geometry_of_spec(THPVariable_Unpack(t.ptr())), -1};
  };
  if (THPVariable_Check(v.ptr())) {
    a.kind = Arg::Kind::Tensor;
    a.tensors.emplace_back(tensor_ref(v));
  } else if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    auto seq = py::reinterpret_borrow<py::sequence>(v);
    bool tensors = false, ints = true;
    for (auto e : seq) {
      tensors |= THPVariable_Check(e.ptr());
      ints &= py::isinstance<py::int_>(e) && !py::isinstance<py::bool_>(e);
    }
    if (tensors) {
      a.kind = Arg::Kind::OptionalTensorList;
      for (auto e : seq) {
        if (THPVariable_Check(e.ptr())) a.tensors.emplace_back(tensor_ref(e));
        else a.tensors.emplace_back(std::nullopt);
      }
    } else if (ints) {
      a.constant = seq.cast<std::vector<int64_t>>();
    }
  } else if (py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v)) {
    a.constant = v.cast<int64_t>();
  }
  return a;
}

torch_mgpu::plan::Work work_of(std::map<std::string, double> work) {
  return torch_mgpu::plan::partition_work(work["gemm_flops"], work["elem"], work["transcendental"], work["bytes"]);
}
} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_mgpu: lazy multi-lane executor behind the mgpu device";
  torch_mgpu::capture::set_interpreter_lock({&gil_held, &gil_release, &gil_restore, &python_interrupt, &python_error_handled});
  // Every call that reaches the engine lets go of the GIL while it runs
  // (results are converted to Python objects after it is taken back).
  using nogil = py::call_guard<py::gil_scoped_release>;
  // Errors raised at a sync name the Python line that recorded the op;
  // frames in these directories (torch's, torch_mgpu's) are passed over.
  m.def("_install_caller", &torch_mgpu::python::install_caller);
  // PyTorch's Python Meta kernels check an out= tensor's resize in Python
  // and warn at once, in their own words (torch/_prims_common/wrappers.py;
  // torch._resize_output_ hands ATen's warning to Python on return). While
  // mgpu infers a call, these wrappers run ATen's check instead, its warning
  // held with the call's (torch_mgpu/_meta_warnings.py installs them).
  // Elsewhere the original is called as it was: same arguments (symbolic
  // sizes stay symbolic), and no Python frame of ours, so a warning's
  // stacklevel names the line it named.
  m.def("_wrap_resize_output_check", [](py::function check) {
    return py::cpp_function([check](py::args args, py::kwargs kwargs) -> py::object {
      if (!torch_mgpu::capture::inferring_results() || args.size() != 2 || !kwargs.empty())
        return check(*args, **kwargs);
      return py::bool_(at::native::resize_output_check(py::cast<at::Tensor>(args[0]),
                                                       py::cast<std::vector<int64_t>>(args[1])));
    });
  });
  m.def("_wrap_resize_output_", [](py::function resize) {
    return py::cpp_function([resize](py::args args, py::kwargs kwargs) -> py::object {
      if (!torch_mgpu::capture::inferring_results() || args.size() != 3 || !kwargs.empty())
        return resize(*args, **kwargs);
      at::_resize_output_(py::cast<at::Tensor>(args[0]), py::cast<std::vector<int64_t>>(args[1]),
                          py::cast<c10::Device>(args[2]));
      return args[0];
    });
  });
  torch_mgpu::python::bind_tiers(m);
  m.def("synchronize", &torch_mgpu::synchronize, nogil());
  m.def("pending_ops", &torch_mgpu::pending_ops, nogil());
  m.def("stats", &torch_mgpu::stats, nogil());
  m.def("empty_cache", &torch_mgpu::empty_cache, nogil());
  m.def("max_pending_ops", &torch_mgpu::max_pending_ops, nogil());
  m.def("set_max_pending_ops", &torch_mgpu::set_max_pending_ops, nogil());
  m.def("async_ops", &torch_mgpu::async_ops, nogil());
  m.def("set_async_ops", &torch_mgpu::set_async_ops, nogil());
  m.def("_wait_for_flight", &torch_mgpu::wait_for_flight, nogil());
  m.def("device_count", [] { return 1; });
  m.def("check_device_index", [](int64_t index) {
    torch_mgpu::capture::check_device_index(static_cast<c10::DeviceIndex>(std::clamp<int64_t>(index, -2, 127)));
  });
  m.def("in_forked_child_with_lanes", &torch_mgpu::runtime::in_bad_fork);
  m.def("default_generator", [](int index) {
    return py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(torch_mgpu::capture::default_generator(index)));
  });
  m.def("manual_seed_all", [](uint64_t seed) {
    auto gen = torch_mgpu::capture::default_generator(0);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }, nogil());
  m.def("configure", &torch_mgpu::configure, py::arg("devices"), py::arg("lanes_per_device"), py::arg("policy"),
        nogil());
  m.def("lanes", &torch_mgpu::lanes, nogil());
  m.def("_set_process_group", &torch_mgpu::set_process_group, nogil());
  m.def("_serve", &torch_mgpu::serve_as_worker, nogil());
  m.def("_release_workers", &torch_mgpu::release_workers, nogil());
  m.def("policy", [] { return torch_mgpu::policy(); }, nogil());
  py::class_<PlanHandle>(m, "_PlanRecord")
      .def("summary", &plan_summary)
      .def("timeline", &plan_timeline)
      .def("dot", [](const PlanHandle& h) { return torch_mgpu::ir::to_dot(h.rec->graph, h.rec->lane_of); });
  m.def("_last_plan", [] {
    std::shared_ptr<const torch_mgpu::engine::PlanRecord> rec;
    {
      py::gil_scoped_release nogil;
      rec = torch_mgpu::engine::last_plan();
    }
    return plan_handle(std::move(rec));
  });
  m.def("_cost_model", [] {
    torch_mgpu::plan::CostModel cm;
    {
      py::gil_scoped_release nogil;  // the first call calibrates on the lanes
      cm = torch_mgpu::engine::cost_model();
    }
    py::dict d;
    for (const auto& f : torch_mgpu::plan::cost_figures()) d[f.name] = cm.*f.field;
    d["calibrated"] = cm.calibrated;
    return d;
  });
  // A model pinned for every plan (tests that assert a plan's shape): the
  // default figures with the given ones over them; None: the calibrated one.
  m.def("_pin_cost_model", [](const py::object& figures) {
    std::optional<torch_mgpu::plan::CostModel> cm;
    if (!figures.is_none()) {
      torch_mgpu::plan::CostModel model;
      model.calibrated = true;
      for (auto item : figures.cast<py::dict>()) {
        const auto key = item.first.cast<std::string>();
        if (key == "calibrated") continue;
        const auto& known = torch_mgpu::plan::cost_figures();
        auto f = std::find_if(known.begin(), known.end(), [&](const auto& c) { return key == c.name; });
        TORCH_CHECK(f != known.end(), "torch_mgpu._pin_cost_model: unknown figure '", key, "'");
        model.*(f->field) = item.second.cast<double>();
      }
      cm = model;
    }
    py::gil_scoped_release nogil;  // runs what is pending
    torch_mgpu::engine::pin_cost_model(std::move(cm));
  });
  m.def("_replay_blocker", [] {
    py::gil_scoped_release nogil;  // the state lock
    return torch_mgpu::engine::replay_blocker_of_pending();
  });
  m.def("_check_env", &torch_mgpu::ir::env::check_all);
  // The variables whose text check_all() parses (and refuses at import).
  m.def("_env_checked", [] {
    std::vector<std::string> out;
    for (const auto& v : torch_mgpu::ir::env::table())
      if (v.kind != torch_mgpu::ir::env::Kind::Text && v.kind != torch_mgpu::ir::env::Kind::Switch) out.push_back(v.name);
    return out;
  });
  // The environment variables (ir/env.h): each name, its default and meaning.
  m.def("_env_table", [] {
    py::list out;
    for (const auto& v : torch_mgpu::ir::env::table()) out.append(py::make_tuple(v.name, v.fallback, v.meaning));
    return out;
  });
  // A variable's text (None where unset): Python reads the table's
  // variables through this, and only those.
  m.def("_env_text", [](const std::string& name) -> std::optional<std::string> {
    for (const auto& v : torch_mgpu::ir::env::table())
      if (name == v.name) return torch_mgpu::ir::env::text(v.var);
    TORCH_CHECK_VALUE(false, "torch_mgpu: ", name, " is not one of its environment variables (ir/env.cpp)");
  });
  m.def("_cost_model_pinned", [] { return torch_mgpu::engine::cost_model_pinned(); });
  // torch.compile's partitioner (torch_mgpu/_partition.py) asks the model
  // that plans: an op's work, as a partition's figures (gemm_flops, elem,
  // transcendental, bytes); what such work costs on one of `lanes` lanes;
  // and the makespan of pieces run as partitions over `lanes` lanes.
  m.def("_op_work", [](const std::string& name, const std::string& overload, const py::sequence& args,
                       const py::sequence& outputs) {
    auto op = c10::Dispatcher::singleton().findSchema({name, overload});
    TORCH_CHECK(op.has_value(), "torch_mgpu: no operator ", name, overload.empty() ? "" : ".", overload);
    std::vector<torch_mgpu::ir::Arg> in;
    for (auto a : args) in.push_back(op_arg(a));
    std::vector<torch_mgpu::ir::Output> out;
    for (auto o : outputs) {
      if (!THPVariable_Check(o.ptr())) continue;
      torch_mgpu::ir::Output r;
      r.geom = geometry_of_spec(THPVariable_Unpack(o.ptr()));
      double n = 1;
      for (auto d : r.geom.sizes) n *= static_cast<double>(d);
      r.nbytes = static_cast<size_t>(n) * c10::elementSize(r.geom.dtype);
      r.returned = static_cast<int>(out.size());
      out.push_back(std::move(r));
    }
    const auto w = torch_mgpu::plan::estimate_op_work(op->schema(), in, out);
    // A node's work as a partition's figures: its flops at the rate of its kind.
    std::map<std::string, double> d{{"gemm_flops", w.gemm ? w.flops : 0.0},
                                    {"elem", !w.gemm && !w.transcendental ? w.flops : 0.0},
                                    {"transcendental", !w.gemm && w.transcendental ? w.flops : 0.0},
                                    {"bytes", w.bytes}};
    return d;
  });
  m.def("_work_seconds", [](std::map<std::string, double> work, int lanes) {
    return torch_mgpu::engine::work_seconds(work_of(std::move(work)), lanes);
  }, nogil());
  m.def("_split_groups", [](const std::vector<double>& cost, const std::vector<std::vector<int>>& preds, int lanes) {
    return torch_mgpu::engine::split_groups(cost, preds, lanes);
  }, py::arg("cost"), py::arg("preds"), py::arg("lanes"), nogil());
  m.def("_partition_makespan", &torch_mgpu::engine::partition_makespan, py::arg("seconds"), py::arg("preds"),
        py::arg("lanes"), nogil());
  // The one measured choice (ir/trial.h), for the compile backend's
  // partitions-or-whole choice (torch_mgpu/compile.py): way 0 the baseline.
  using torch_mgpu::ir::Trial;
  py::class_<Trial>(m, "_Trial")
      .def(py::init<size_t, size_t, double>(), py::arg("ways"), py::arg("runs"), py::arg("margin"))
      .def("turn", [](const Trial& t) { return t.turn(); })
      .def("call", &Trial::call, py::arg("way"))
      .def("record", [](Trial& t, size_t way, double seconds) { t.record(way, seconds); }, py::arg("way"),
           py::arg("seconds"))
      .def("all_timed", &Trial::all_timed)
      .def("choose", [](const Trial& t) { return t.choose(); })
      .def("median", &Trial::median_of, py::arg("way"))
      .def("timed_runs", [](const Trial& t, size_t way) { return t.seconds(way).size(); }, py::arg("way"));
  m.attr("_margin_partitions") = torch_mgpu::ir::margin::kPartitions;
  // Tests only: make the n-th node / transfer / event wait / stream
  // synchronize from now throw (runtime/faults.h).
  py::class_<PartitionHandle>(m, "Partition")
      .def_property_readonly("name", [](const PartitionHandle& h) { return std::string(h.p->name); })
      .def_property_readonly("id", [](const PartitionHandle& h) { return h.p->id; })
      .def_property_readonly("ops", [](const PartitionHandle& h) { return h.p->ops; })
      .def_property_readonly("kernels", [](const PartitionHandle& h) { return h.p->kernels; });
  // `inputs` / `outputs`: tensors (Meta is fine) with the geometries the
  // code was compiled for; `work`: gemm_flops, elem, transcendental, bytes.
  m.def("_make_partition", [](py::function fn, std::vector<std::string> ops, int kernels,
                              const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                              std::map<std::string, double> work) {
    std::vector<torch_mgpu::ir::TensorGeometry> in, out;
    for (const auto& t : inputs) in.push_back(geometry_of_spec(t));
    for (const auto& t : outputs) out.push_back(geometry_of_spec(t));
    auto p = torch_mgpu::ir::make_partition(torch_mgpu::python::tensors_fn(std::move(fn)), std::move(ops), kernels,
                                            std::move(in), std::move(out));
    p->gemm_flops = work["gemm_flops"];
    p->elem = work["elem"];
    p->transcendental = work["transcendental"];
    p->bytes = work["bytes"];
    p->threads = static_cast<int>(work["threads"]);
    return PartitionHandle{std::move(p)};
  });
  m.def("_call_partition", [](const PartitionHandle& h, const std::vector<at::Tensor>& inputs) {
    return torch_mgpu::backend::call_partition(h.p, inputs);
  }, nogil());
  m.def("_alias_tensor", &torch_mgpu::backend::alias_tensor, nogil());
  m.def("_value_view", [](const at::Tensor& t, const std::string& device) {
    return torch_mgpu::backend::value_view(t, c10::Device(device));
  }, nogil());
  m.def("_inject_fault", &torch_mgpu::runtime::inject_fault, py::arg("point"), py::arg("n") = 1, py::arg("only") = "");
  m.def("_faults_fired", &torch_mgpu::runtime::faults_fired);
  m.def("_stream_sanitizer_start", &torch_mgpu::engine::start_stream_sanitizer, nogil());
  m.def("_stream_sanitizer_stop", &torch_mgpu::engine::stop_stream_sanitizer, nogil());
  m.def("_stream_sanitizer_races", &torch_mgpu::runtime::take_stream_sanitizer_races);
  m.def("_stream_sanitizer_accesses", &torch_mgpu::runtime::stream_sanitizer_accesses);
  m.def("_device_profiles", [] {
    py::dict out;
    for (const auto& d : torch_mgpu::plan::device_profiles()) {
      py::dict p;
      p["description"] = d.description;
      p["sms"] = d.sms;
      p["fp32_flops_per_s"] = d.fp32_flops_per_s;
      p["memory_bytes_per_s"] = d.memory_bytes_per_s;
      p["launch_s"] = d.launch_s;
      p["host_bytes_per_s"] = d.host_bytes_per_s;
      p["peer_bytes_per_s"] = d.peer_bytes_per_s;
      p["memory_bytes"] = d.memory_bytes;
      out[py::str(d.name)] = p;
    }
    return out;
  });
  m.def("_simulate", [](int devices, int lanes, const std::string& policy, const std::string& device, int hosts) {
    torch_mgpu::engine::Simulation s;
    {
      py::gil_scoped_release nogil;
      s = torch_mgpu::engine::simulate(devices, lanes, policy, device, hosts);
    }
    py::dict d;
    d["makespan"] = s.makespan;
    d["lower_bound"] = s.lower_bound;
    d["critical_path"] = s.critical_path;
    d["total_work"] = s.total_work;
    d["plan"] = plan_handle(s.plan);
    return d;
  });
}
