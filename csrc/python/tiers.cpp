// Hot graphs as Python data for the compile thread (torch_mgpu/_tiers/compile.py),
// and its compiled functions back to the engine.
#include "python/tiers.h"
#include "runtime/lanes.h"

#include "engine/at_call.h"
#include "engine/replays.h"
#include "engine/tiers.h"

#include <pybind11/stl.h>
#include <pthread.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

namespace py = pybind11;

namespace torch_mgpu::python {

namespace {
thread_local bool compile_thread = false;  // this thread serves compile requests (_tier_next_request)

// A compile ended on the compile thread: inductor ran kernels while it
// compiled, and they may have made an OpenMP team there. It lets it go
// before the compiled code is installed (runtime::release_thread_team).
void compile_done() {
  if (compile_thread) runtime::release_thread_team();
}
} // namespace
namespace {

py::tuple geometry(const ir::TensorGeometry& g) {
  return py::make_tuple(std::vector<int64_t>(g.sizes.begin(), g.sizes.end()),
                        std::vector<int64_t>(g.strides.begin(), g.strides.end()), g.offset,
                        py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(g.dtype))));
}

// A constant as Python passes it to the op: enums by their Python objects.
py::object constant(const c10::IValue& v, const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
  if (v.isInt()) {
    const auto i = v.toInt();
    switch (t->kind()) {
      case c10::TypeKind::ScalarTypeType:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(i))));
      case c10::TypeKind::LayoutType:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(i))));
      case c10::TypeKind::MemoryFormatType:
        return py::reinterpret_steal<py::object>(
            torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(i)));
      default:
        break;
    }
  }
  return torch::jit::toPyObject(v);
}

py::object ref(const std::optional<ir::TensorRef>& r) {
  if (!r) return py::none();
  return py::make_tuple(r->operand, geometry(r->geom), r->same);
}

py::dict request_dict(const engine::CompileRequest& req) {
  py::dict d;
  d["key"] = req.key;
  d["lanes"] = req.lanes;
  d["lane"] = req.lane;
  d["device"] = req.device;
  py::list parts;
  for (const auto& p : req.parts) parts.append(request_dict(p));
  d["parts"] = parts;
  py::list leaves;
  for (const auto& l : req.leaves) leaves.append(l.nbytes);
  d["leaves"] = leaves;
  d["roots"] = req.roots;
  d["varying"] = req.varying;
  py::list nodes;
  for (const auto& n : req.nodes) {
    const auto& schema = n.op.schema();
    py::dict nd;
    nd["op"] = schema.name();
    nd["overload"] = schema.overload_name();
    py::list args;
    for (size_t k = 0; k < n.args.size(); ++k) {
      const auto& a = n.args[k];
      const auto& sa = schema.arguments().at(k);
      py::object value;
      switch (a.kind) {
        case ir::Arg::Kind::Constant:
          value = py::make_tuple("c", constant(a.constant, sa.real_type()));
          break;
        case ir::Arg::Kind::Tensor:
          value = py::make_tuple("t", ref(a.tensors.at(0)));
          break;
        case ir::Arg::Kind::TensorList:
        case ir::Arg::Kind::OptionalTensorList: {
          py::list refs;
          for (const auto& r : a.tensors) refs.append(ref(r));
          value = py::make_tuple("l", refs);
          break;
        }
      }
      args.append(py::make_tuple(sa.name(), sa.kwarg_only(), value));
    }
    nd["args"] = args;
    nd["operands"] = n.operands;
    py::list outs;
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      const auto& o = n.outputs[k];
      outs.append(py::make_tuple(n.output_values.at(k), o.mutated_operand, o.returned, o.nbytes, geometry(o.geom)));
    }
    nd["outputs"] = outs;
    py::list written;
    for (const auto& w : n.written) written.append(py::make_tuple(w.arg, w.element, geometry(w.after)));
    nd["written"] = written;
    nodes.append(nd);
  }
  d["nodes"] = nodes;
  return d;
}

} // namespace

void bind_tiers(py::module& m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("_tier_compile_hits", &engine::compile_hits);
  m.def("_set_tier_compile_hits", &engine::set_compile_hits);
  m.def("_set_tier_trial", &engine::set_compile_trial);
  // Replay of hot graphs on stream lanes (engine/replays.h): off (0) by default.
  m.def("_replay_hits", &engine::replay_hits);
  m.def("_set_replay_hits", &engine::set_replay_hits);
  // Replays measured against the run without them before they are kept
  // (on by default; the replay tests turn it off to replay every time).
  m.def("_replay_trial", &engine::replay_trial);
  m.def("_set_replay_trial", &engine::set_replay_trial);
  // Running at the call (engine/at_call.h): the setting, and each trace's choice.
  m.def("_set_at_call", &engine::at_call::set_mode);
  m.def("_at_call", &engine::at_call::mode);
  m.def("_trace_choices", [] {
    py::list out;
    for (const auto& r : engine::at_call::report()) {
      py::dict d;
      d["trace"] = r.trace;
      d["ops"] = r.ops;
      d["runs"] = r.runs;
      d["way"] = r.way;
      d["state"] = r.state;
      d["medians_s"] = r.medians_s;
      d["why"] = r.why;
      out.append(d);
    }
    return out;
  });
  m.def("_capture_checks", &engine::capture_checks);
  m.def("_set_capture_checks", &engine::set_capture_checks);
  m.def("_replay_pool_limit", [] {
    const auto l = engine::replay_pool_limit();
    return std::make_pair(l.bytes, l.recordings);
  });
  m.def("_set_replay_pool_limit", [](size_t bytes, size_t recordings) {
    engine::set_replay_pool_limit(engine::ReplayPoolLimit{bytes, recordings});
  });
  m.def("_tier_trial", &engine::compile_trial);
  m.def("_tier_compiler_present", &engine::set_compiler_present, nogil());
  m.def("_tier_stop", &engine::stop_compiles, nogil());
  m.def("_tier_wait", &engine::wait_for_compiles, nogil());
  // The next hot graph as a dict, or None once the thread is to stop.
  m.def("_tier_next_request", [] {
    std::shared_ptr<const engine::CompileRequest> req;
    {
      py::gil_scoped_release nogil;
      if (!compile_thread) {
        compile_thread = true;
        pthread_setname_np(pthread_self(), "mgpu-compile");  // as `top -H`, perf and gdb show it
      }
      req = engine::next_compile_request();
    }
    if (!req) return py::object(py::none());
    return py::object(request_dict(*req));
  });
  // ways: the ways compiled (the whole graph; its parts, for a split
  // request), each (parts, compile seconds, description), a part (fn, input
  // dtypes, lifted (node, argument), description).
  m.def("_tier_install", [](uint64_t key, std::vector<py::tuple> ways) {
    std::vector<std::shared_ptr<engine::CompiledGraph>> compiled;
    for (const auto& way : ways) {
      TORCH_CHECK(way.size() == 3, "_tier_install: a way is (parts, compile seconds, description)");
      auto c = std::make_shared<engine::CompiledGraph>();
      for (const auto& p : way[0].cast<std::vector<py::tuple>>()) {
        TORCH_CHECK(p.size() == 4, "_tier_install: a part is (fn, dtypes, lifted, description)");
        engine::CompiledPart part;
        part.run = tensors_fn(p[0].cast<py::function>());
        for (const auto& d : p[1].cast<std::vector<py::object>>()) {
          TORCH_CHECK(THPDtype_Check(d.ptr()), "_tier_install: input dtypes must be torch.dtype");
          part.input_dtypes.push_back(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type);
        }
        part.lifted = p[2].cast<std::vector<std::pair<int, int>>>();
        part.description = p[3].cast<std::string>();
        c->parts.push_back(std::move(part));
      }
      c->compile_s = way[1].cast<double>();
      c->description = way[2].cast<std::string>();
      compiled.push_back(std::move(c));
    }
    py::gil_scoped_release nogil;
    compile_done();
    engine::install_compiled(key, std::move(compiled));
  });
  m.def("_tier_reject", [](uint64_t key, const std::string& why) {
    compile_done();
    engine::reject_compiled(key, why);
  }, nogil());
  m.def("_tier_last_error", &engine::last_tier_error, nogil());
}

} // namespace torch_mgpu::python
