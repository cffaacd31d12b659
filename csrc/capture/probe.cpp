// The CPU probe: a new signature's call run once on the CPU over zeros
// (ones, identities) of its inputs, for eager's errors and warnings at the
// call and the CPU kernel's result geometry where Meta's differs.
#include "capture/record_steps.h"
#include "ir/call_state.h"
#include "ir/env.h"
#include "ir/errors.h"
#include "ir/generators.h"
#include "ir/view.h"

#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <optional>

namespace torch_mgpu::capture {
namespace {

using ir::Arg;
using ir::TensorGeometry;

// Meta kernels check shapes but rarely dtypes or other arguments: a CPU
// kernel raises "not implemented for 'Bool'", "expected m1 and m2 to have
// the same dtype", "alpha must not be a floating point number" only when
// run. For a new signature with small inputs, the call runs once on CPU
// over zeros of the same shapes and dtypes: a call eager itself could make.
// An error it raises that does not come from the data is raised at the
// call, as eager raises it, even when the result is never read. An error
// that zeros provoke and ones do not (an integer division by zero), or a
// LinAlgError (a singular matrix of zeros), comes from the data: it is left
// to the sync, where the real data decides. Random ops draw from throwaway
// generators there (see probe_errors). A large call first runs over
// zeros whose every dim is cut to at most 2 (microseconds): where that
// passes, the checks passed; where it fails (perhaps only because of the cut
// shapes: a view's sizes, an index past the cut), it runs in full as a
// small call does, up to 2^24 input elements. Larger calls that fail that
// cheap run raise their dtype errors at the sync, naming the op.
int64_t input_numel(c10::ArrayRef<c10::IValue> args) {
  int64_t n = 0;
  for (const auto& v : args) for_each_tensor(v, [&](const at::Tensor& t) { n += t.numel(); });
  return n;
}

// Bytes of the distinct mgpu storages the call touches.
size_t storage_bytes(c10::ArrayRef<c10::IValue> args) {
  std::vector<const c10::StorageImpl*> seen;
  size_t n = 0;
  for (const auto& v : args)
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!is_mgpu(t)) return;
      const auto* impl = t.storage().unsafeGetStorageImpl();
      if (std::find(seen.begin(), seen.end(), impl) != seen.end()) return;
      seen.push_back(impl);
      n += impl->nbytes();
    });
  return n;
}

// Zeros of `t`'s dtype, each dim cut to at most `cut` (the rank and the
// empty dims kept), laid out in `t`'s order: strides rank its dims as `t`'s do
// (equal strides stay equal, a broadcast dim stays broadcast), so that a
// kernel that lays its result out by its inputs' strides (TensorIterator)
// lays the cut result out in the order it gives the call's.
at::Tensor cut_in_order(const at::Tensor& t, int64_t cut) {
  const int64_t nd = t.dim();
  std::vector<int64_t> sizes(static_cast<size_t>(nd)), strides(static_cast<size_t>(nd), 0), dims;
  for (int64_t d = 0; d < nd; ++d) {
    sizes[d] = std::min<int64_t>(t.size(d), cut);
    if (!(t.stride(d) == 0 && t.size(d) > 1)) dims.push_back(d);
  }
  if (t.numel() == 0) return at::zeros(sizes, at::TensorOptions().dtype(t.scalar_type()));  // no order to keep
  std::stable_sort(dims.begin(), dims.end(), [&](int64_t a, int64_t b) { return t.stride(a) < t.stride(b); });
  int64_t next = 1;
  for (size_t i = 0; i < dims.size();) {
    size_t j = i;
    int64_t grow = 1;
    for (; j < dims.size() && t.stride(dims[j]) == t.stride(dims[i]); ++j) {
      strides[dims[j]] = next;
      grow = std::max(grow, sizes[dims[j]]);
    }
    next *= grow;
    i = j;
  }
  const auto extent = static_cast<int64_t>(at::detail::computeStorageNbytes(sizes, strides, 1));
  return at::zeros({std::max<int64_t>(extent, 1)}, at::TensorOptions().dtype(t.scalar_type())).as_strided(sizes, strides);
}

// The call's arguments for a probe without aliasing: each mgpu tensor a CPU
// tensor of zeros of its dtype and sizes (a `cut` above 0: cut_in_order),
// the mgpu device the CPU, a Generator a throwaway one. `filled` gets the
// tensors of zeros.
torch::jit::Stack zero_arguments(c10::ArrayRef<c10::IValue> args, int64_t cut, std::vector<at::Tensor>* filled) {
  torch::jit::Stack s;
  for (const auto& v : args) {
    if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) {
      s.emplace_back(c10::Device(c10::kCPU));
      continue;
    }
    if (v.isGenerator()) {  // the probe draws from a throwaway generator
      s.emplace_back(at::make_generator<at::CPUGeneratorImpl>(0));
      continue;
    }
    s.push_back(map_tensors(v, [&](const at::Tensor& t) {
      if (!is_mgpu(t)) return t;
      at::Tensor z = cut > 0 ? cut_in_order(t, cut) : at::zeros(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
      if (filled) filled->push_back(z);
      return z;
    }));
  }
  return s;
}

// What the probe's stand-ins for mgpu tensors hold: zeros, ones, or
// identity matrices (floating and complex tensors of two or more dims: ones on the
// diagonal of their last two; others ones), which factorizations and solves
// take (zeros and ones are singular).
enum class Fill { Zeros, Ones, Identity };

// Runs the call on CPU over zeros (or ones, or identities) in place of the mgpu tensors.
// Each mgpu storage becomes one CPU storage (when they are small), so that
// views that share bytes share them here too and the kernel's overlap
// checks see what eager's would (`c[idx] = c` on a column of a matrix).
// With `written` (small calls, whose twins keep the mgpu tensors' layout),
// the geometry each written tensor was left with, in the order of the
// call's written slots (left empty for large calls).
// `kept_layout` (if given) says whether the twins had the mgpu tensors'
// geometry (small calls), so that the results' strides are eager's.
torch::jit::Stack probe_call(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, Fill fill,
                             c10::WarningHandler* warnings,
                             std::vector<ir::TensorGeometry>* written = nullptr, bool* kept_layout = nullptr) {
  constexpr size_t kMaxAliasedBytes = size_t{1} << 20;
  torch::jit::Stack s;
  std::vector<at::Tensor> filled;  // the tensors standing for mgpu ones
  std::vector<at::Tensor> written_twins;
  if (storage_bytes(args) <= kMaxAliasedBytes) {
    Call twins;
    twins.build_meta = true;
    twins.cpu_twins = true;
    s = meta_arguments(op.schema(), args, twins);
    for (const auto& v : s)
      for_each_tensor(v, [&](const at::Tensor& t) {
        for (const auto& m : twins.meta)
          if (t.storage().unsafeGetStorageImpl() == m.unsafeGetStorageImpl()) filled.push_back(t);
      });
    written_twins.assign(twins.mutated_meta.begin(), twins.mutated_meta.end());
    if (kept_layout) *kept_layout = true;
  } else {
    s = zero_arguments(args, /*cut=*/0, &filled);
  }
  throwaway_generators(op.schema(), s);
  at::AutoDispatchBelowADInplaceOrView guard;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  c10::WarningUtils::WarningHandlerGuard to(warnings ? warnings : &ir::silent_warnings());
  if (fill != Fill::Zeros)
    for (auto& t : filled) {
      try {
        if (fill == Fill::Identity && t.dim() >= 2 && (t.is_floating_point() || t.is_complex()))
          t.diagonal(0, -2, -1).fill_(1);
        else
          t.fill_(1);
      } catch (const c10::Error&) {
        // An expanded view (stride 0) cannot be filled; its storage is, by
        // another view of it or not at all.
      }
    }
  call_drawing_nothing(op, s);
  if (written) {
    written->clear();
    for (const auto& t : written_twins) written->push_back(geometry_of(t));
  }
  return s;
}

// The call on CPU over zeros of the mgpu tensors' dtypes, each dim cut to at
// most `cut` (the rank and the empty dims stay): the dtype checks of a large
// call at the cost of a tiny one.
torch::jit::Stack probe_cut(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int64_t cut = 2) {
  torch::jit::Stack s = zero_arguments(args, cut, nullptr);
  throwaway_generators(op.schema(), s);
  at::AutoDispatchBelowADInplaceOrView guard;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  c10::WarningUtils::WarningHandlerGuard silenced(&ir::silent_warnings());
  call_drawing_nothing(op, s);
  return s;
}

// Where a Meta kernel promises another dtype or shape than the CPU kernel
// gives (PyTorch's Python Meta kernel for `bool_tensor ** False` says int64,
// CPU gives bool; `nansum(x, dim=[])` keeps x's shape on Meta, CPU reduces
// every dim), the fresh result takes the CPU kernel's, so that the mgpu
// tensor is what eager returns and the kernel's bytes need no cast. With
// `strides_too` (the probe's inputs had the mgpu tensors' layout), a dense
// result also takes the CPU kernel's strides: TensorIterator lays out
// `floor_divide(a, b.t())` or `a.t() != 0.5` otherwise than some Meta
// kernels do, and a later `view` must succeed or fail as in eager.
void take_cpu_results(const torch::jit::Stack& cpu, MetaResult& r, bool sizes_too, bool strides_too) {
  std::vector<at::Tensor> flat;
  for (const auto& v : cpu) {
    if (v.isTensor()) flat.push_back(v.toTensor());
    else if (v.isTensorList())
      for (const auto& t : v.toTensorList()) flat.push_back(t);
    else
      return;  // not one tensor per Meta result: leave Meta's
  }
  if (flat.size() != r.tensors.size()) return;
  for (size_t k = 0; k < flat.size(); ++k) {
    const auto& t = flat[k];
    auto& m = r.tensors[k];
    if (!t.defined() || !m.defined || m.alias >= 0) continue;
    const bool other_sizes = sizes_too && t.sizes() != c10::IntArrayRef(m.geom.sizes);
    // (Strides of a result of at most one element are the kernel's choice
    // too: `(0, 1, 2)-shaped * (1,)` is (2, 0, 1) in eager.)
    const bool other_strides = strides_too && !other_sizes && (t.numel() <= 1 || t.is_non_overlapping_and_dense()) &&
        (t.strides() != c10::IntArrayRef(m.geom.strides) || m.geom.offset != 0);
    if (t.scalar_type() == m.geom.dtype && !other_sizes && !other_strides) continue;
    m.geom.dtype = t.scalar_type();
    if (other_sizes) {
      m.geom.sizes.assign(t.sizes().begin(), t.sizes().end());
      const auto strides = c10::contiguous_strides(t.sizes());
      m.geom.strides.assign(strides.begin(), strides.end());
      m.geom.offset = 0;
    } else if (other_strides) {
      m.geom.strides.assign(t.strides().begin(), t.strides().end());
      m.geom.offset = 0;
    }
    const size_t item = c10::elementSize(t.scalar_type());
    m.nbytes = at::detail::computeStorageNbytes(m.geom.sizes, m.geom.strides, item) +
        static_cast<size_t>(m.geom.offset) * item;
  }
}

// A large call's cut run (cut_in_order) tells the order in which the CPU
// kernel lays out its results' dims: kernels lay results out by the order of
// their inputs' dims (TensorIterator, empty_like, suggest_memory_format) or
// in a fixed one (contiguous, LAPACK's column-major), not by their sizes.
// Each fresh result whose cut has its rank and its dims of length 0 and 1
// (each longer dim longer in both: a convolution's output over a cut is
// shorter) takes that order over its own sizes, dense (dims ranked by the cut
// result's strides, a dim of size 1 before a larger one of the same stride,
// as TensorIterator strides them). Meta kernels' layouts differ from the
// CPU kernels' in many (batch norm and fft of a transposed input, svd, eig,
// logical_and, copysign). Returns whether every fresh result of more than one
// element took one.
bool take_cpu_order(const torch::jit::Stack& cpu, MetaResult& r) {
  std::vector<at::Tensor> flat;
  for (const auto& v : cpu) {
    if (!v.isTensor()) return false;
    flat.push_back(v.toTensor());
  }
  if (flat.size() != r.tensors.size()) return false;
  bool all = true;
  for (size_t k = 0; k < flat.size(); ++k) {
    const auto& t = flat[k];
    auto& m = r.tensors[k];
    if (!m.defined || m.alias >= 0) continue;
    const auto& sizes = m.geom.sizes;
    if (c10::multiply_integers(sizes) <= 1) continue;  // no order to tell (its strides are Meta's)
    // The same rank, and the same dims of one element or none: each longer
    // dim is longer in both (a convolution's output over a wider cut is).
    bool cut_of_it = t.defined() && t.dim() == static_cast<int64_t>(sizes.size()) && t.numel() > 1 &&
        t.is_non_overlapping_and_dense();
    for (int64_t d = 0; cut_of_it && d < t.dim(); ++d)
      cut_of_it = (t.size(d) <= 1 || sizes[d] <= 1) ? t.size(d) == sizes[d] : true;
    if (!cut_of_it) {
      all = false;
      continue;
    }
    std::vector<int64_t> dims(sizes.size());
    std::iota(dims.begin(), dims.end(), 0);
    std::stable_sort(dims.begin(), dims.end(), [&](int64_t a, int64_t b) {
      return t.stride(a) != t.stride(b) ? t.stride(a) < t.stride(b) : t.size(a) < t.size(b);
    });
    int64_t next = 1;
    for (int64_t d : dims) {
      m.geom.strides[d] = next;
      next *= sizes[d];
    }
    m.geom.offset = 0;
    m.nbytes = static_cast<size_t>(next) * c10::elementSize(m.geom.dtype);
  }
  return all;
}

// Whether cut copies keep what decides the order of the call's dims: not
// where an input has two dims longer than 1 of one stride (an overlapping
// view: `x.unfold(0, 200, 1)`, strides (1, 1)), whose order in eager follows
// their lengths, which the cut makes equal. Meta's layout stands there.
bool cut_keeps_order(c10::ArrayRef<c10::IValue> args) {
  bool keeps = true;
  for (const auto& v : args)
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!is_mgpu(t)) return;
      for (int64_t a = 0; a < t.dim(); ++a)
        for (int64_t b = a + 1; b < t.dim(); ++b)
          if (t.size(a) > 1 && t.size(b) > 1 && t.stride(a) != 0 && t.stride(a) == t.stride(b)) keeps = false;
    });
  return keeps;
}

// The order of dims from a run over a copy cut to at most 16 per dim, where
// the cut to 2 could not tell (a convolution's kernel is longer than 2; the
// cut result's shape lost a dim's length) and the run is small (up to 2^18
// input elements: a tensor of 7 long dims is not): whether every fresh result
// took one.
bool order_from_wider_cut(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, MetaResult& r) {
  constexpr int64_t kCut = 16;
  constexpr int64_t kMaxCutNumel = int64_t{1} << 18;  // a run of at most this many input elements
  int64_t numel = 0;
  for (const auto& v : args)
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!is_mgpu(t)) return;
      int64_t n = 1;
      for (int64_t d : t.sizes()) n = std::min(n * std::min(d, kCut), kMaxCutNumel + 1);  // no overflow
      numel += n;
    });
  if (numel > kMaxCutNumel) return false;
  try {
    return take_cpu_order(probe_cut(op, args, kCut), r);
  } catch (const std::exception& e) {
    ir::rethrow_if_interrupt(e);
    return false;  // Meta's layout stands
  }
}

// Where the CPU kernel leaves a written tensor with another geometry than
// Meta promised (an out= tensor of the right numel keeps its shape in
// linspace's CPU kernel; an empty out= of cat takes its inputs' channels-last
// layout), the tensor ends as eager leaves it. `written`: from the probe, in
// the order of the call's written slots (empty: nothing known).
void take_cpu_written(const std::vector<ir::TensorGeometry>& written, MetaResult& r) {
  if (written.size() != r.mutated_geom.size()) return;
  for (size_t k = 0; k < written.size(); ++k) {
    const auto& g = written[k];
    if (g == r.mutated_geom[k] || g.dtype != r.mutated_geom[k].dtype) continue;
    r.mutated_geom[k] = g;
    const size_t item = c10::elementSize(g.dtype);
    r.mutated_nbytes[k] = std::max(r.mutated_nbytes[k], at::detail::computeStorageNbytes(g.sizes, g.strides, item) +
                                                             static_cast<size_t>(g.offset) * item);
  }
}

// Factorizations and solves refuse singular matrices, which zeros and ones
// both are: only their "not implemented for" errors are the call's.
bool refuses_singular(const std::string& name) {
  return name.find("linalg") != std::string::npos || name.rfind("aten::cholesky", 0) == 0 ||
      name.rfind("aten::inverse", 0) == 0 || name.rfind("aten::lu", 0) == 0 || name.rfind("aten::_lu", 0) == 0;
}

// Whether the call's mgpu tensors are all out= arguments (it reads none).
bool only_out_tensors(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args) {
  for (size_t i = 0; i < args.size() && i < schema.arguments().size(); ++i)
    if (!schema.arguments()[i].is_out() && holds_mgpu(args[i])) return false;
  return true;
}

using ir::message_of;

} // namespace

// Returns whether the CPU kernel ran over the call's own sizes and returned
// (on zeros, ones or identities): `warned` then holds what eager's call
// warns (its out= resize warnings, a uint8 mask's deprecation), and
// `cpu_strides` whether the results' strides are the kernel's over the
// call's own layouts (small calls), `cpu_order` whether the results took
// the order of their dims from the kernel's run over cut inputs (large ones).
bool probe_errors(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, MetaResult& meta,
                  HeldWarnings& warned, bool& cpu_strides, bool& cpu_order) {
  const int64_t max_probe_numel = full_probe_numel();
  const auto& schema = op.schema();
  // Only ATen's own kernels: a custom op's kernel may be any code (a
  // compiled partition, Python), not to be run on made-up inputs.
  if (schema.name().rfind("aten::", 0) != 0) return false;
  // Random ops are probed too (their bounds checks: `random_(0, -1)`,
  // `uniform_(0, -42)`), moving no generator (call_drawing_nothing).
  constexpr int64_t kMaxFullProbeNumel = int64_t{1} << 24;
  // Tensor results only, one per MetaResult tensor, in order.
  bool plain = true;
  for (const auto& ret : meta.returns) plain = plain && ret.kind != MetaReturn::Kind::None;
  const int64_t numel = input_numel(args);
  // A large call's results may take their order of dims from a cut run.
  const bool order_from_cut = plain && numel > max_probe_numel && cut_keeps_order(args);
  if (numel > max_probe_numel) {
    try {
      auto results = probe_cut(op, args);
      if (plain) take_cpu_results(results, meta, /*sizes_too=*/false, /*strides_too=*/false);
      if (order_from_cut) cpu_order = take_cpu_order(results, meta) || order_from_wider_cut(op, args, meta);
      return false;
    } catch (const std::exception& e) {
      ir::rethrow_if_interrupt(e);
      // The cut shapes, or the call: the full run tells. A call whose only
      // mgpu tensors are out= tensors (`randperm(n, out=t)`, `arange(...,
      // out=t)`) had nothing cut that it reads: its error is the call's.
      if (only_out_tensors(schema, args)) throw;
    }
    if (numel > kMaxFullProbeNumel) {
      if (order_from_cut) cpu_order = order_from_wider_cut(op, args, meta);
      return false;
    }
  }
  try {
    std::vector<ir::TensorGeometry> written;
    bool kept_layout = false;
    auto results = probe_call(op, args, Fill::Zeros, &warned, &written, &kept_layout);
    if (plain) take_cpu_results(results, meta, /*sizes_too=*/true, kept_layout);
    take_cpu_written(written, meta);
    cpu_strides = plain && kept_layout;
    // A large call whose cut raised: the full run had contiguous inputs.
    if (order_from_cut && !kept_layout) cpu_order = order_from_wider_cut(op, args, meta);
    return true;
  } catch (const c10::LinAlgError&) {
  } catch (const std::exception& e) {
    ir::rethrow_if_interrupt(e);
    const std::string msg = message_of(e);
    if (msg.find("not implemented for '") != std::string::npos) throw;
    if (refuses_singular(schema.name())) {
      // Zeros are singular: identities are not. An error on them too is
      // the call's (an out= tensor of another dtype: `linalg.solve_triangular
      // (A, B, out=long_tensor)`), whatever the data.
      HeldWarnings on_identities;
      try {
        probe_call(op, args, Fill::Identity, &on_identities);
      } catch (const c10::LinAlgError&) {
        return false;
      } catch (const std::exception& again) {
        ir::rethrow_if_interrupt(again);
        if (message_of(again).find("singular") != std::string::npos) return false;
        throw;
      }
      warned.take_over(std::move(on_identities));
      return true;
    }
    std::exception_ptr on_zeros = std::current_exception();
    HeldWarnings on_ones;
    try {
      probe_call(op, args, Fill::Ones, &on_ones);
    } catch (const std::exception& again) {
      ir::rethrow_if_interrupt(again);
      std::rethrow_exception(on_zeros);  // zeros and ones alike: not the data
    }
    warned.take_over(std::move(on_ones));
    return true;
  }
  return false;
}

int64_t full_probe_numel() {
  static const int64_t limit = ir::env::integer(ir::env::Var::FullProbeNumel, int64_t{1} << 14);
  return limit;
}

void call_drawing_nothing(const c10::OperatorHandle& op, torch::jit::Stack& s) {
  if (op.hasTag(at::Tag::nondeterministic_seeded) && !has_generator_arg(op.schema()))
    ir::call_with_own_generator(op, s, c10::Device(c10::kCPU), std::nullopt);
  else
    op.callBoxed(&s);
}

} // namespace torch_mgpu::capture
