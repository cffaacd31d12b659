// Lazy capture: every ATen op on mgpu tensors arrives here boxed. Its output
// geometry comes from running it on Meta tensors (cached per signature);
// the call is recorded as one IR node. Views alias the mgpu storage directly,
// in-place and out= ops produce the next version of the written storages.
// The steps record() takes are in this folder's files (record_steps.h).
#include "capture/record_steps.h"
#include "capture/caller.h"
#include "capture/random.h"
#include "ir/call_state.h"
#include "ir/partition.h"
#include "runtime/counters.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace torch_mgpu::capture {
namespace {

using ir::Arg;
using ir::TensorGeometry;

// ATen's warning for an out= tensor with elements that a call resizes
// (at::native::resize_output_check).
bool is_resize_warning(const c10::Warning& w) {
  return w.msg().rfind("An output with one or more elements was resized", 0) == 0;
}

// An argument for the node: mgpu tensors become views of operands; CPU
// tensors are snapshotted (eager copies them at the call too).
struct NodeBuilder {
  Call& call;
  ir::Node& node;
  // Host tensors snapshotted so far (a call has few): one snapshot each.
  c10::SmallVector<std::pair<c10::TensorImpl*, ir::TensorRef>, 1> cpu_refs;
  // Appends the reference to `t` to `refs`, built in place.
  void add(c10::SmallVectorImpl<std::optional<ir::TensorRef>>& refs, const at::Tensor& t) {
    if (!t.defined()) {
      refs.emplace_back();
      return;
    }
    if (is_mgpu(t)) {
      const size_t k = call.seen_at(t);
      auto& r = refs.emplace_back(std::in_place);
      r->operand = call.index_at(t);
      // A tensor passed once: its geometry is not read again.
      if (call.seen_count[k] > 1) r->geom = call.seen_geometry[k];
      else r->geom = std::move(call.seen_geometry[k]);
      r->same = call.seen_count[k] > 1 ? static_cast<int>(k) : -1;
      return;
    }
    for (const auto& [impl, ref] : cpu_refs)
      if (impl == t.unsafeGetTensorImpl()) {
        refs.emplace_back(ref);
        return;
      }
    at::Tensor snap = t.clone(at::MemoryFormat::Contiguous);
    ir::TensorRef r{static_cast<int>(node.operands.size()), geometry_of(snap)};
    node.operands.push_back(ir::Value{ir::make_data(snap.storage()), 0});
    cpu_refs.emplace_back(t.unsafeGetTensorImpl(), r);
    refs.emplace_back(std::move(r));
  }
};

// A view must lie inside its storage. Meta kernels cannot check (a Meta
// storage has no bytes; as_strided accepts any offset there); CPU and CUDA
// do, with this message. Without it a view would read past the bytes.
void check_in_storage(const TensorGeometry& g, const c10::Storage& storage) {
  const size_t item = c10::elementSize(g.dtype);
  const size_t extent = at::detail::computeStorageNbytes(g.sizes, g.strides, item);
  if (extent == 0) return;  // no elements: any storage will do
  const size_t needed = extent + static_cast<size_t>(g.offset) * item;
  TORCH_CHECK(needed <= storage.nbytes(), "setStorage: sizes ", c10::IntArrayRef(g.sizes), ", strides ",
              c10::IntArrayRef(g.strides), ", storage offset ", g.offset, ", and itemsize ", item,
              " requiring a storage size of ", needed, " are out of bounds for storage of size ", storage.nbytes());
}

// Phase 1. What the call returns and writes (geometries, dtypes): from the
// signature cache, else inferred (Meta, or CPU where there is no Meta
// kernel) and checked as eager checks at the call (the probe). Fills
// `call` with the storages read and written. `fresh` holds a result that
// was not cached; `warnings` holds the call's warnings until it is recorded.
const MetaResult& infer_call(const OpInfo& info, const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                             Call& call, MetaResult& fresh, HeldWarnings& warnings) {
  const auto& schema = op.schema();
  const bool cpu_as_meta = call.cpu_as_meta;
  call.scale_args = info.scale_args;
  meta_arguments(schema, args, call);
  const MetaResult* cached = call.key.cacheable ? meta_cache_find(call.key, &info.last_signature) : nullptr;
  if (cached) {
    runtime::counters().meta_cache_hits++;
  } else {
    runtime::counters().meta_cache_misses++;
    // The same walk with Meta twins: storage indices come out the same.
    Call full;
    full.cpu_as_meta = cpu_as_meta;
    full.build_meta = true;
    full.scale_args = info.scale_args;
    auto margs = meta_arguments(schema, args, full);
    // The call's warnings come once: the CPU kernel's where the probe ran
    // it over the call's sizes (eager's own), else Meta's.
    HeldWarnings from_meta;
    HeldWarnings from_probe;
    bool probed = false;
    {
      c10::WarningUtils::WarningHandlerGuard held(&from_meta);
      try {
        fresh = infer(op, std::move(margs), full);
      } catch (const c10::NotImplementedError& e) {
        if (!no_meta_kernel(e)) throw;
        // The CPU run checked the dtypes too, and warned as eager does.
        fresh = infer_without_meta(op, args, cpu_as_meta, from_probe);
        probed = true;
      }
    }
    // Meta's out= layouts give way to the given ones first, then to what
    // the CPU kernel did where the probe ran it over the call's layouts
    // (linalg kernels restride an empty out= tensor to column-major).
    if (!probed) keep_out_layouts(schema, full, fresh);
    bool cpu_strides = false;  // the results' strides are the CPU kernel's over the call's layouts
    bool cpu_order = false;    // the results' order of dims is the CPU kernel's
    const bool exact = probed || probe_errors(op, args, fresh, from_probe, cpu_strides, cpu_order);
    // An out= tensor's resize warning is eager's at every call with these
    // sizes: it goes with the cached result. Others make the call uncached
    // (the next call warns again, as eager does for a uint8 mask's
    // deprecation, or not, for a kernel that warns once).
    // Meta's resize warning stands only where an out= tensor's sizes change:
    // arange into an out= tensor of its numel keeps the tensor's shape, and
    // eager does not warn (Meta's kernel makes it one-dimensional).
    const bool resized = exact || resizes_an_out(schema, full, fresh);
    for (auto& w : (exact ? from_probe : from_meta).held) {
      if (!is_resize_warning(w)) warnings.held.push_back(std::move(w));
      else if (resized) fresh.resize_warnings.push_back(std::move(w));
    }
    // A probe that raised half-way (a singular matrix of zeros) may have
    // given a warning once per process: it is the call's, unless Meta warned.
    if (!exact && warnings.held.empty())
      for (auto& w : from_probe.held)
        if (!is_resize_warning(w)) warnings.held.push_back(std::move(w));
    if (info.batch_norm) saves_nothing_in_eval(schema, args, fresh);
    if (info.contiguous_result ||
        (info.contiguous_if_complex && !args.empty() && args[0].isTensor() && args[0].toTensor().is_complex())) {
      make_contiguous(fresh);
    } else if (follows_iterator_layout(op) && !cpu_strides) {
      follow_input_layout(schema, full, args, fresh, /*results_too=*/!cpu_order);
    }
    if (call.key.cacheable && warnings.held.empty()) meta_cache_put(call.key, fresh);
    cached = &fresh;
  }
  return *cached;
}

// A call whose results are all views of its storages, which it does not
// write (view, unsqueeze, as_strided, expand).
bool only_views(const Call& call, const MetaResult& mr) {
  if (!call.mutated_slots.empty() || mr.tensors.empty()) return false;
  for (const auto& t : mr.tensors)
    if (!t.defined || t.alias < 0) return false;
  return true;
}

// An input whose computation failed is refused at the call, naming it. A
// storage mgpu did not make is refused (buffer_of) unless only viewed.
void check_has_value(const c10::Storage& s, std::string_view op_name, bool only_viewed) {
  if (only_viewed && !is_lazy_storage(s)) return;
  const auto& v = buffer_of(s)->value;
  if (v.node && v.node->kind == ir::NodeKind::Error)
    TORCH_CHECK(false, "mgpu: an input of ", op_name, " has no value: ", v.node->error);
}

// Phase 2. The node and what it reads: the current version of each storage
// it touches, its arguments as a template (tensors name an operand and a
// geometry; host tensors are snapshotted; generators become seeded ones).
std::shared_ptr<ir::Node> node_for(const OpInfo& info, const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                   Call& call, const MetaResult& mr) {
  const auto& schema = op.schema();
  const size_t nargs = args.size();
  auto node = ir::new_node();
  node->name = info.name;
  if (!info.aten && nargs > 0)
    if (const auto* p = ir::partition_of(args[0])) node->name = p->name;  // "partition#3[mm, relu; 1 kernel]"
  node->op = op;
  node->operands.reserve(call.storages.size());
  node->args.reserve(nargs);
  node->outputs.reserve(mr.tensors.size() + call.mutated_slots.size());
  for (const auto& s : call.storages) {
    check_has_value(s, node->name, /*only_viewed=*/false);
    node->operands.push_back(buffer_of(s)->value);
  }
  NodeBuilder nb{call, *node, {}};
  bool random = info.random;
  for (size_t i = 0; i < nargs; ++i) {
    const auto& v = args[i];
    Arg& a = node->args.emplace_back();  // filled in place: an Arg is costly to move
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().dim() == 0 && v.toTensor().device().is_cpu()) {
      // A host scalar: a constant of the call. Python numbers arrive as
      // fresh wrapped tensors nobody else holds; others are snapshotted.
      const auto& t = v.toTensor();
      a.constant = t.unsafeGetTensorImpl()->is_wrapped_number() ? t : t.clone();
    } else if (v.isTensor() && v.toTensor().defined()) {
      a.kind = Arg::Kind::Tensor;
      nb.add(a.tensors, v.toTensor());
    } else if (v.isTensorList()) {
      a.kind = Arg::Kind::TensorList;
      for (const auto& t : v.toTensorList()) nb.add(a.tensors, t);
    } else if (v.isOptionalTensorList()) {
      a.kind = Arg::Kind::OptionalTensorList;
      for (const auto& e : v.toOptionalTensorList()) {
        std::optional<at::Tensor> ot = e;
        if (ot && ot->defined()) nb.add(a.tensors, *ot);
        else a.tensors.emplace_back();
      }
    } else if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) {
      a.constant = c10::Device(c10::kCPU);
    } else if (random && (v.isGenerator() || (v.isNone() && is_generator(schema.arguments()[i])))) {
      std::optional<at::Generator> g;
      if (v.isGenerator()) g = v.toGenerator();
      a.constant = at::make_generator<at::CPUGeneratorImpl>(draw_seed(g));
    } else {
      a.constant = v;
    }
  }
  if (info.seeded_default && !draws_nothing(schema, args)) node->seed = draw_seed(std::nullopt);

  return node;
}

// What phase 3 made: the tensors the call returns, and the storages it
// writes with the node output that is each one's next version.
struct Outputs {
  // Inline: most calls return a tensor or two and write at most one storage.
  c10::SmallVector<at::Tensor, 2> results;
  c10::SmallVector<int, 2> written;         // distinct storage indices written
  c10::SmallVector<int, 2> written_output;  // per written storage: its node output
};

// Phase 3. The node's outputs: fresh returned tensors (new storages whose
// value is the node's output; an empty factory's are Empty values), views
// of inputs, then the next versions of written storages (grown to their
// largest written extent). Nothing anyone else can see changes yet.
Outputs outputs_of(Call& call, const MetaResult& mr, const std::shared_ptr<ir::Node>& node, bool empty_factory) {
  Outputs o;
  auto& results = o.results;
  auto& written = o.written;
  for (const auto& m : call.mutated_slots) {
    int idx = call.index_at(m);
    if (std::find(written.begin(), written.end(), idx) == written.end()) written.push_back(idx);
  }
  for (size_t k = 0; k < mr.tensors.size(); ++k) {
    const auto& t = mr.tensors[k];
    if (!t.defined) {
      results.emplace_back();
    } else if (t.alias >= 0) {
      // A view, or the written tensor itself (in-place and out= return it).
      at::Tensor same;
      for (const auto& m : call.mutated_slots)
        if (call.index_at(m) == t.alias) same = m;
      if (!same.defined()) check_in_storage(t.geom, call.storages[t.alias]);
      results.push_back(same.defined() ? same : make_lazy_tensor(call.storages[t.alias], t.geom));
    } else if (empty_factory) {
      results.push_back(make_lazy_tensor(new_storage(t.nbytes, call.device, ir::make_empty(t.nbytes)), t.geom));
    } else {
      const int out_index = static_cast<int>(node->outputs.size());
      ir::Output& out = node->outputs.emplace_back();  // built in place: a geometry is costly to copy
      out.nbytes = t.nbytes;
      out.returned = static_cast<int>(k);
      out.geom = t.geom;
      results.push_back(make_lazy_tensor(new_storage(t.nbytes, call.device, node, out_index), t.geom));
    }
  }
  // Written storages grow (resize_, out=) to their largest written extent.
  auto& written_output = o.written_output;
  written_output.resize(written.size());
  for (size_t w = 0; w < written.size(); ++w) {
    const int idx = written[w];
    size_t nbytes = call.storages[idx].nbytes();
    for (size_t k = 0; k < call.mutated_slots.size(); ++k)
      if (call.index_at(call.mutated_slots[k]) == idx)
        nbytes = std::max(nbytes, mr.mutated_nbytes[k]);
    written_output[w] = static_cast<int>(node->outputs.size());
    ir::Output& out = node->outputs.emplace_back();
    out.nbytes = nbytes;
    out.mutated_operand = idx;
  }
  return o;
}

// Phase 4, the commit: the written storages move to their next version,
// written tensors take their new geometry. Nothing here throws.
void commit(Call& call, const MetaResult& mr, const std::shared_ptr<ir::Node>& node, const Outputs& o) {
  for (size_t w = 0; w < o.written.size(); ++w) {
    const int idx = o.written[w];
    const size_t nbytes = node->outputs[o.written_output[w]].nbytes;
    if (nbytes > call.storages[idx].nbytes()) call.storages[idx].unsafeGetStorageImpl()->set_nbytes(nbytes);
    buffer_of(call.storages[idx])->value = ir::Value{node, o.written_output[w]};
  }
  for (size_t k = 0; k < call.mutated_slots.size(); ++k) {
    auto* impl = call.mutated_slots[k].unsafeGetTensorImpl();
    const auto& g = mr.mutated_geom[k];
    if (geometry_of(call.mutated_slots[k]) != g) impl->set_sizes_and_strides(g.sizes, g.strides, g.offset);
  }
}

// The results replace the arguments on the stack, as the op's schema returns them.
void push_results(torch::jit::Stack* stack, size_t nargs, const MetaResult& mr, c10::ArrayRef<at::Tensor> results,
                  BorrowedArgs* borrowed) {
  if (borrowed) borrowed->release();
  torch::jit::drop(*stack, nargs);
  size_t next = 0;
  for (const auto& ret : mr.returns) {
    if (ret.kind == MetaReturn::Kind::Tensor) {
      stack->emplace_back(results[next++]);
    } else if (ret.kind == MetaReturn::Kind::TensorList) {
      c10::List<at::Tensor> l;
      for (int i = 0; i < ret.count; ++i) l.push_back(results[next++]);
      stack->emplace_back(l);
    } else {
      stack->emplace_back();
    }
  }
}

} // namespace

bool record_empty(const OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                  const ir::CallState& state) {
  if (!info.empty_factory || (state.deterministic && state.fill_uninitialized)) return false;
  const auto& formals = op.schema().arguments();
  const size_t nargs = formals.size();
  c10::ArrayRef<c10::IValue> args(stack->data() + stack->size() - nargs, nargs);
  // empty(size, dtype, layout, device, pin_memory, memory_format) or
  // empty_strided(size, stride, dtype, layout, device, pin_memory).
  const bool strided = nargs > 1 && formals[1].name() == "stride";
  const size_t opts = strided ? 2 : 1;
  if (nargs < 6) return false;  // both take six arguments
  auto dims = [](const c10::IValue& v, ir::Dims& out) {
    if (!v.isIntList()) return false;  // symbolic sizes: record()
    for (const int64_t x : v.toIntList()) {
      if (x < 0) return false;  // record() raises eager's error
      out.push_back(x);
    }
    return true;
  };
  const auto& dtype = args[opts];
  const auto& layout = args[opts + 1];
  const auto& device = args[opts + 2];
  const auto& pinned = args[opts + 3];
  if (!(layout.isNone() || (layout.isInt() && static_cast<c10::Layout>(layout.toInt()) == c10::kStrided))) return false;
  if (!(pinned.isNone() || (pinned.isBool() && !pinned.toBool()))) return false;
  if (!device.isDevice() || device.toDevice().type() != c10::DeviceType::PrivateUse1) return false;
  if (!strided) {
    const auto& format = args[opts + 4];
    if (!(format.isNone() || (format.isInt() && static_cast<c10::MemoryFormat>(format.toInt()) == c10::MemoryFormat::Contiguous)))
      return false;
  }
  ir::TensorGeometry g;
  g.dtype = dtype.isNone() ? state.default_dtype : static_cast<c10::ScalarType>(dtype.toInt());
  // complex32's kernels warn that it is experimental: record() gives that warning.
  if (g.dtype == c10::ScalarType::ComplexHalf) return false;
  if (!dims(args[0], g.sizes)) return false;
  check_device_index(device.toDevice().index());
  const size_t item = c10::elementSize(g.dtype);
  size_t nbytes = 0;
  if (strided) {
    if (!dims(args[1], g.strides) || g.strides.size() != g.sizes.size()) return false;
    nbytes = at::detail::computeStorageNbytes(g.sizes, g.strides, item);
  } else {
    nbytes = at::detail::computeStorageNbytesContiguous(g.sizes, item);  // raises eager's overflow error first
    g.strides.resize(g.sizes.size());
    int64_t stride = 1;
    for (size_t d = g.sizes.size(); d-- > 0;) {
      g.strides[d] = stride;
      stride *= std::max<int64_t>(g.sizes[d], 1);
    }
  }
  const auto index = std::max<c10::DeviceIndex>(device.toDevice().index(), 0);
  at::Tensor t = make_lazy_tensor(new_storage(nbytes, index, ir::make_empty(nbytes)), g);
  torch::jit::drop(*stack, nargs);
  stack->emplace_back(std::move(t));
  return true;
}

// The phases: the call's signature (the cache key), what it returns and
// writes (infer_call), the node and its inputs (node_for), its outputs
// (outputs_of), then, once the node is complete and hashed, the commit and
// the results. Any phase before the commit may raise: nothing is recorded.
bool record(const OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack, bool cpu_as_meta,
            const ir::CallState& state, BorrowedArgs* borrowed) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  // The arguments, in place on the stack until the results replace them.
  c10::ArrayRef<c10::IValue> args(stack->data() + stack->size() - nargs, nargs);

  // The signature (and the storages read and written) without Meta twins.
  Call call;
  call.cpu_as_meta = cpu_as_meta;
  call.key.add(reinterpret_cast<intptr_t>(&schema));  // the operator, the settings, then its arguments
  // The settings kernels read (Meta's included: the default dtype decides
  // an integer division's result type, a deterministic mode makes some
  // calls raise) are part of the key and go with the node.
  call.key.add(static_cast<int64_t>(state.default_dtype) | int64_t{state.deterministic} << 8 |
               int64_t{state.deterministic_warn_only} << 9 | int64_t{state.fill_uninitialized} << 10 |
               int64_t{state.matmul_precision} << 11);
  MetaResult fresh;
  HeldWarnings warnings;
  const MetaResult& mr = infer_call(info, op, args, call, fresh, warnings);
  if (only_views(call, mr)) {
    // Views of the call's storages, nothing computed or written: no node.
    // The storages' bytes are not touched, so a storage mgpu did not make
    // takes views as on the CPU (a wrapper subclass's, under no_dispatch).
    for (const auto& s : call.storages) check_has_value(s, info.name, /*only_viewed=*/true);
    Outputs o = outputs_of(call, mr, nullptr, false);
    warnings.release();
    for (const auto& w : mr.resize_warnings) c10::warn(w);
    push_results(stack, nargs, mr, o.results, borrowed);
    return info.aten;
  }
  auto node = node_for(info, op, args, call, mr);
  // torch.empty's bytes are an Empty value, allocated where first read,
  // unless deterministic mode fills uninitialized memory: then the kernel
  // runs (under the call's settings) and fills them, as eager's does.
  const bool uninitialized = info.empty_factory && !(state.deterministic && state.fill_uninitialized);
  Outputs o = outputs_of(call, mr, node, uninitialized);
  node->written.reserve(call.mutated_slots.size());
  for (size_t k = 0; k < call.mutated_slots.size(); ++k)
    node->written.push_back(ir::Written{call.mutated_at[k].first, call.mutated_at[k].second, mr.mutated_geom[k]});
  node->state = state;
  node->grad_mode = at::GradMode::is_enabled();
  if (info.thread_sensitive) node->call_threads = static_cast<int16_t>(at::get_num_threads());
  node->where = caller_location();
  // Memoized now, on the recording thread, not at the sync. All but the
  // operands is fixed by the signature, unless host tensors were
  // snapshotted (whether two are one tensor is not in the signature).
  if (node->operands.size() != call.storages.size()) {
    node->hash();
  } else {
    if (!mr.node_hash_prefix) mr.node_hash_prefix = node->hash_prefix();
    node->hash_from_prefix(*mr.node_hash_prefix);
  }
  warnings.release();
  for (const auto& w : mr.resize_warnings) c10::warn(w);

  commit(call, mr, node, o);
  if (!node->outputs.empty()) runtime::counters().ops_captured++;
  push_results(stack, nargs, mr, o.results, borrowed);
  // Ops outside aten may have Python kernels (custom ops), which need the
  // GIL; seeded ops borrow the global generator while they run.
  return !node->seed && info.aten;
}

} // namespace torch_mgpu::capture
