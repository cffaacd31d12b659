// Layout corrections: where a Meta kernel's result geometry is not eager's
// (TensorIterator's layouts, out= tensors that keep theirs, batch norm's
// empty statistics in eval mode), the recorded geometry is eager's.
#include "capture/record_steps.h"

#include <c10/core/MemoryFormat.h>

#include <optional>

namespace torch_mgpu::capture {
namespace {

using ir::Arg;
using ir::TensorGeometry;

// Whether written slot `k` is an out= tensor whose sizes the call changes.
bool resizes_out(const c10::FunctionSchema& schema, const Call& call, const MetaResult& r, size_t k) {
  return schema.arguments()[call.mutated_at[k].first].is_out() &&
      r.mutated_geom[k].sizes != geometry_of(call.mutated_slots[k]).sizes;
}

// The strides TensorIterator gives a fresh output of `sizes` over the
// call's tensor inputs (ATen's TensorIteratorBase: compute_fast_setup_type,
// reorder_dimensions, allocate_or_resize_outputs), which eager's pointwise
// kernels use. Meta kernels disagree where they are not TensorIterator's:
// a composite over an empty out= tensor (abs, logical_not: contiguous) or a
// Python reference (logical_and, copysign, xlogy, polar: their own order).
// Empty where it cannot tell: a tensor list among the inputs, no tensor
// input, inputs that do not broadcast to `sizes`.
std::optional<std::vector<int64_t>> iterator_layout(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                                                    c10::IntArrayRef sizes) {
  c10::SmallVector<const at::Tensor*, 4> inputs;
  for (size_t i = 0; i < args.size(); ++i) {
    if (i < schema.arguments().size() && schema.arguments()[i].is_out()) continue;
    if (args[i].isTensorList() || args[i].isOptionalTensorList() || args[i].isList()) return std::nullopt;
    if (args[i].isTensor() && args[i].toTensor().defined()) inputs.push_back(&args[i].toTensor());
  }
  if (inputs.empty()) return std::nullopt;
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  // Each input's strides over the output's dimensions: 0 where it is
  // broadcast (a missing leading dimension, or a size 1 against another).
  c10::SmallVector<c10::SmallVector<int64_t, 6>, 4> strides;
  bool same_shape = true, scalars = false, tensors = false;
  for (const at::Tensor* t : inputs) {
    const int64_t d = t->dim();
    if (d > ndim) return std::nullopt;
    (d == 0 ? scalars : tensors) = true;
    same_shape = same_shape && t->sizes() == sizes && !(scalars && tensors);
    auto& st = strides.emplace_back(static_cast<size_t>(ndim), 0);
    for (int64_t k = 0; k < d; ++k) {
      const int64_t at = ndim - d + k;
      if (t->size(k) != sizes[at] && t->size(k) != 1) return std::nullopt;
      st[at] = (t->size(k) == 1 && sizes[at] != 1) ? 0 : t->stride(k);
    }
  }
  const auto contiguous = c10::contiguous_strides(sizes);
  if (same_shape) {
    bool is_contiguous = true, channels_last = true, dense = true;
    for (const at::Tensor* t : inputs) {
      is_contiguous = is_contiguous && t->is_contiguous();
      channels_last = channels_last && t->is_contiguous(at::MemoryFormat::ChannelsLast);
      dense = dense && t->is_non_overlapping_and_dense();
    }
    if (is_contiguous) return std::vector<int64_t>(contiguous.begin(), contiguous.end());
    if (channels_last) return c10::get_channels_last_strides_2d(sizes);
    bool alike = dense;
    for (const at::Tensor* t : inputs) alike = alike && t->strides() == inputs.back()->strides();
    if (alike) return inputs.back()->strides().vec();
  }
  // Dimensions sorted fastest first: by the first input whose strides tell
  // two apart (a broadcast one tells nothing), an equal stride putting the
  // smaller dimension first.
  std::vector<int64_t> perm(static_cast<size_t>(ndim));
  for (int64_t j = 0; j < ndim; ++j) perm[j] = ndim - 1 - j;
  auto should_swap = [&](int64_t d0, int64_t d1) {
    for (const auto& st : strides) {
      if (st[d0] == 0 || st[d1] == 0) continue;
      if (st[d0] != st[d1]) return st[d0] < st[d1] ? -1 : 1;
      if (sizes[d0] > sizes[d1]) return 1;
    }
    return 0;
  };
  for (int64_t i = 1; i < ndim; ++i) {
    int64_t d1 = i;
    for (int64_t d0 = i - 1; d0 >= 0; --d0) {
      const int c = should_swap(perm[d0], perm[d1]);
      if (c > 0) {
        std::swap(perm[d0], perm[d1]);
        d1 = d0;
      } else if (c < 0) {
        break;
      }
    }
  }
  std::vector<int64_t> out(static_cast<size_t>(ndim));
  int64_t next = 1;
  bool reversed = true;
  for (int64_t j = 0; j < ndim; ++j) {
    reversed = reversed && perm[j] == ndim - 1 - j;
    out[perm[j]] = next;
    next *= sizes[perm[j]];
  }
  if (reversed) return std::vector<int64_t>(contiguous.begin(), contiguous.end());
  return out;
}

// eager restrides an out= tensor only when it resizes it; an out= tensor of
// the right size keeps its layout, and the kernel writes through it (a
// structured kernel computes into a contiguous proxy and copies back). Some
// Meta kernels restride it anyway (sort into `empty(12)[::2]` comes back
// contiguous): the tensor keeps its own layout, as in eager. In-place ops
// (`transpose_`, `as_strided_`) are not out= arguments: Meta's geometry
// stands.
//
// arange, range, linspace and logspace resize their out= tensor only when
// its number of elements is not the one they make; otherwise it keeps its
// shape (a (100, 100, 3) tensor takes arange(30000)). Their Meta kernels
// make it one-dimensional.
bool resizes_out_on_numel(const c10::FunctionSchema& schema) {
  const auto& n = schema.name();
  return n == "aten::arange" || n == "aten::range" || n == "aten::linspace" || n == "aten::logspace";
}

} // namespace

// Ops whose CPU kernels lay results out by their inputs' strides alone
// (TensorIterator's): the pointwise ones, and a few TensorIterator kernels
// PyTorch does not tag so.
bool follows_iterator_layout(const c10::OperatorHandle& op) {
  if (op.hasTag(at::Tag::pointwise)) return true;
  const auto& n = op.schema().name();
  return n == "aten::floor_divide" || n == "aten::complex" || n == "aten::polar";
}

// Batch norm in eval mode: Meta kernels promise saved statistics of shape
// [C], CPU (and CUDA) kernels return empty ones; mgpu gives what eager does.
void saves_nothing_in_eval(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args, MetaResult& r) {
  bool training = false;
  for (size_t i = 0; i < args.size(); ++i)
    if (schema.arguments()[i].name() == "training" && args[i].isBool()) training = args[i].toBool();
  if (training || r.tensors.size() < 3) return;
  for (size_t k = 1; k < 3; ++k) {
    auto& t = r.tensors[k];
    if (!t.defined || t.alias >= 0) continue;
    t.geom.sizes = {0};
    t.geom.strides = {1};
    t.geom.offset = 0;
    t.nbytes = 0;
  }
}

// Fresh results and resized out= tensors of a pointwise op are laid out as
// TensorIterator lays them out (where the CPU kernel did not run over the
// call's own layouts to tell).
void follow_input_layout(const c10::FunctionSchema& schema, const Call& call, c10::ArrayRef<c10::IValue> args,
                         MetaResult& r, bool results_too) {
  auto follow = [&](ir::TensorGeometry& out) {
    if (out.offset != 0 || c10::IntArrayRef(out.strides) != c10::IntArrayRef(c10::contiguous_strides(out.sizes)))
      return;
    if (auto strides = iterator_layout(schema, args, out.sizes)) out.strides.assign(strides->begin(), strides->end());
  };
  if (results_too && r.tensors.size() == 1 && r.tensors[0].defined && r.tensors[0].alias < 0) follow(r.tensors[0].geom);
  // An out= tensor the call resizes (the empty one a composite made) is
  // laid out as a fresh result; one of the right size keeps its own.
  for (size_t k = 0; k < call.mutated_slots.size() && k < r.mutated_geom.size(); ++k)
    if (resizes_out(schema, call, r, k)) follow(r.mutated_geom[k]);
}

void make_contiguous(MetaResult& r) {
  if (r.tensors.size() != 1 || !r.tensors[0].defined || r.tensors[0].alias >= 0) return;
  auto& out = r.tensors[0].geom;
  const auto contiguous = c10::contiguous_strides(out.sizes);
  out.strides.assign(contiguous.begin(), contiguous.end());
}

void keep_out_layouts(const c10::FunctionSchema& schema, const Call& call, MetaResult& r) {
  const bool by_numel = resizes_out_on_numel(schema);
  for (size_t k = 0; k < call.mutated_slots.size() && k < r.mutated_geom.size(); ++k) {
    const auto& a = schema.arguments()[call.mutated_at[k].first];
    if (!a.is_out()) continue;
    const auto before = geometry_of(call.mutated_slots[k]);
    auto& after = r.mutated_geom[k];
    if (after.dtype != before.dtype || after == before) continue;
    if (after.sizes == before.sizes || (by_numel && c10::multiply_integers(after.sizes) == c10::multiply_integers(before.sizes)))
      after = before;
  }
}

// Whether the call changes the sizes of one of its out= tensors.
bool resizes_an_out(const c10::FunctionSchema& schema, const Call& call, const MetaResult& r) {
  for (size_t k = 0; k < call.mutated_slots.size() && k < r.mutated_geom.size(); ++k)
    if (resizes_out(schema, call, r, k)) return true;
  return false;
}

} // namespace torch_mgpu::capture
