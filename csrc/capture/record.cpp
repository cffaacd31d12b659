// Lazy capture: every ATen op on mgpu tensors arrives here boxed. Its output
// geometry comes from running it on Meta tensors (cached per signature);
// the call is recorded as one IR node. Views alias the mgpu storage directly,
// in-place and out= ops produce the next version of the written storages.
#include "ir/env.h"
#include "capture/arguments.h"
#include "capture/caller.h"
#include "capture/capture.h"
#include "capture/meta_cache.h"
#include "ir/call_state.h"
#include "ir/partition.h"
#include "capture/random.h"
#include "ir/view.h"
#include "runtime/counters.h"

#include <ATen/Parallel.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/SmallVector.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/op_registration/op_registration.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace torch_mgpu::capture {
namespace {

using ir::Arg;
using ir::TensorGeometry;

// Ops decided before shape inference: they need data (item, nonzero), or
// return something other than tensors.
bool needs_eager(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  // Meta kernels that promise other output shapes than CPU delivers.
  static const std::unordered_set<std::string> meta_disagrees = {"aten::_embedding_bag_forward_only",
                                                                 "aten::_embedding_bag"};
  if (meta_disagrees.count(schema.name())) return true;
  if (op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output))
    return true;
  if (schema.returns().empty()) {
    bool writes = false;
    for (const auto& a : schema.arguments())
      if (a.alias_info() && a.alias_info()->isWrite()) writes = true;
    return !writes;  // asserts and the like: run them now
  }
  for (const auto& r : schema.returns()) {
    const auto& t = r.type();
    if (t->kind() == c10::TypeKind::TensorType) continue;
    if (t->kind() == c10::TypeKind::ListType &&
        t->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::TensorType)
      continue;
    if (t->kind() == c10::TypeKind::OptionalType &&
        t->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType)
      continue;
    return true;
  }
  return false;
}

// A Generator or Generator? argument.
bool is_generator(const c10::Argument& a) {
  auto t = a.type();
  if (t->kind() == c10::TypeKind::OptionalType) t = t->castRaw<c10::OptionalType>()->getElementType();
  return t->kind() == c10::TypeKind::GeneratorType;
}

bool has_generator_arg(const c10::FunctionSchema& s) {
  for (const auto& a : s.arguments())
    if (is_generator(a)) return true;
  return false;
}

// A probe's generators: where the call passes none (it would draw from the
// default CPU generator), a throwaway one, as for a Generator it passes.
// Restoring the default generator after the probe undid whatever another
// thread drew from it meanwhile: it handed out the same numbers twice.
void throwaway_generators(const c10::FunctionSchema& schema, torch::jit::Stack& s) {
  const auto& formals = schema.arguments();
  for (size_t i = 0; i < formals.size() && i < s.size(); ++i)
    if (s[i].isNone() && is_generator(formals[i])) s[i] = at::make_generator<at::CPUGeneratorImpl>(0);
}

// Holds warnings back until the call is recorded: a call that raises (and
// runs eagerly instead, which warns again) gives its warnings once.
struct HeldWarnings : c10::WarningHandler {
  std::vector<c10::Warning> held;
  void process(const c10::Warning& w) override { held.push_back(w); }
  void release() {
    for (const auto& w : held) c10::warn(w);
    held.clear();
  }
  // A full run's warnings replace a run's that raised half-way, keeping
  // those only the first gave (a warning given once per process).
  void take_over(HeldWarnings&& full) {
    for (auto& w : held) {
      bool again = false;
      for (const auto& f : full.held) again = again || f.msg() == w.msg();
      if (!again) full.held.push_back(std::move(w));
    }
    held = std::move(full.held);
  }
};

// ATen's warning for an out= tensor with elements that a call resizes
// (at::native::resize_output_check).
bool is_resize_warning(const c10::Warning& w) {
  return w.msg().rfind("An output with one or more elements was resized", 0) == 0;
}

bool is_mutated(const c10::Argument& a) { return a.alias_info() && a.alias_info()->isWrite(); }

// Whether an argument is, or holds, an mgpu tensor.
bool holds_mgpu(const c10::IValue& v) {
  bool found = false;
  for_each_tensor(v, [&](const at::Tensor& t) { found = found || is_mgpu(t); });
  return found;
}

// One call being recorded: its distinct mgpu storages and their Meta twins.
struct Call {
  // A call touches a handful of storages and tensors: these hold them
  // without allocating.
  c10::SmallVector<c10::Storage, 4> storages;  // mgpu storages read or written
  c10::SmallVector<c10::Storage, 4> meta;      // their Meta twins, same size
  // Position of a storage in `storages` (-1 if absent). A call touches a
  // handful of storages: a linear scan beats a hash map and allocates nothing.
  int index_of(const c10::StorageImpl* impl) const {
    for (size_t i = 0; i < storages.size(); ++i)
      if (storages[i].unsafeGetStorageImpl() == impl) return static_cast<int>(i);
    return -1;
  }
  int index_at(const at::Tensor& t) const {
    int i = index_of(t.storage().unsafeGetStorageImpl());
    TORCH_INTERNAL_ASSERT(i >= 0, "mgpu: a storage of the call was not recorded");
    return i;
  }
  c10::SmallVector<at::Tensor, 2> mutated_slots;      // mgpu tensors written by the op
  c10::SmallVector<std::pair<int, int>, 2> mutated_at;  // their (argument, list element or -1)
  c10::SmallVector<at::Tensor, 2> mutated_meta;       // their Meta twins
  int arg = 0, element = -1;  // where to_meta's tensor sits in the call
  c10::SmallVector<const c10::TensorImpl*, 4> seen;  // mgpu tensors met so far, how often, and their twins
  c10::SmallVector<int, 4> seen_count;
  c10::SmallVector<at::Tensor, 4> seen_twins;
  c10::SmallVector<TensorGeometry, 2> seen_geometry;  // their geometries, as the key has them
  // The place of an mgpu tensor met by to_meta in `seen`.
  size_t seen_at(const at::Tensor& t) const {
    for (size_t k = 0; k < seen.size(); ++k)
      if (seen[k] == t.unsafeGetTensorImpl()) return k;
    TORCH_INTERNAL_ASSERT(false, "mgpu: a tensor of the call was not recorded");
  }
  SignatureKey key;
  c10::DeviceIndex device = 0;
  bool cpu_as_meta = false;  // copies take a whole CPU tensor as their source
  // Whether to build Meta twins: only on a cache miss. A hit needs the
  // signature and the storages, not a Meta call (nor Meta allocations).
  bool build_meta = false;
  // Twins on the CPU instead, zero-filled: for ops with no Meta kernel
  // (see infer_without_meta).
  bool cpu_twins = false;
  // Bit i: argument i scales a term (OpInfo::scale_args): a float there
  // keys by its class only.
  uint32_t scale_args = 0;

  int storage_index(const at::Tensor& t) {
    int i = index_of(t.storage().unsafeGetStorageImpl());
    if (i >= 0) return i;
    i = static_cast<int>(storages.size());
    storages.push_back(t.storage());
    if (build_meta)
      meta.push_back((cpu_twins ? at::zeros({static_cast<int64_t>(t.storage().nbytes())}, at::TensorOptions().dtype(at::kByte))
                                : at::empty({static_cast<int64_t>(t.storage().nbytes())},
                                            at::TensorOptions().dtype(at::kByte).device(at::kMeta)))
                         .storage());
    return i;
  }

  // The Meta twin of an argument tensor; records its signature. Without
  // `build_meta`, an undefined tensor: a copy of `t` would cost a reference
  // (for a tensor Python holds, an incref and a decref of its Python object).
  at::Tensor to_meta(const at::Tensor& t, bool mutated) {
    if (!t.defined()) {
      key.add(-1);
      return at::Tensor();
    }
    if (!is_mgpu(t)) {
      key.add(-2);
      key.add_geometry(geometry_of(t));
      key.add(static_cast<int64_t>(t.device().type()));
      // A Python number (wrapped) and a 0-dim tensor of the same dtype
      // promote differently (`int_tensor + 2.5` is float32, `int_tensor +
      // torch.tensor(2.5, dtype=torch.float64)` float64).
      key.add(t.unsafeGetTensorImpl()->is_wrapped_number() ? 1 : 0);
      if (!build_meta) return at::Tensor();
      if (cpu_as_meta) return at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
      return t;  // meta kernels accept CPU scalars and refuse the rest, as eager does
    }
    device = t.device().index();
    int i = storage_index(t);
    // The same tensor passed twice (`c[idx] = c`) is one twin: kernels tell
    // it from an equal view (eager refuses an index_put_ from itself).
    int same = -1;
    for (size_t k = 0; k < seen.size(); ++k)
      if (seen[k] == t.unsafeGetTensorImpl()) same = static_cast<int>(k);
    if (same < 0) {
      seen.push_back(t.unsafeGetTensorImpl());
      seen_count.push_back(1);
      seen_geometry.push_back(geometry_of(t));
    } else {
      ++seen_count[same];
    }
    const auto& g = seen_geometry[same < 0 ? seen.size() - 1 : static_cast<size_t>(same)];
    key.add(i);
    key.add(static_cast<int64_t>(storages[i].nbytes()));
    key.add_geometry(g);
    key.add(same);
    if (mutated) {
      mutated_slots.push_back(t);
      mutated_at.emplace_back(arg, element);
    }
    if (!build_meta) return at::Tensor();
    at::Tensor m;
    if (same >= 0) m = seen_twins[same];
    else m = cpu_twins ? ir::make_view(meta[i], c10::DispatchKey::CPU, g) : meta_view(meta[i], g);
    if (same < 0) seen_twins.push_back(m);
    if (mutated) mutated_meta.push_back(m);
    return m;
  }
};

// Meta arguments for `args`, filling `call`.
// Without `call.build_meta` only the signature is wanted: nothing is returned.
std::vector<c10::IValue> meta_arguments(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                                        Call& call) {
  const bool keep = call.build_meta;
  std::vector<c10::IValue> out;
  if (keep) out.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& v = args[i];
    bool mut = is_mutated(schema.arguments()[i]);
    call.arg = static_cast<int>(i);
    call.element = -1;
    if (v.isTensor()) {
      at::Tensor m = call.to_meta(v.toTensor(), mut);
      if (keep) out.emplace_back(std::move(m));
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> l;
      const auto list = v.toTensorList();
      for (const auto& t : list) {
        ++call.element;
        at::Tensor m = call.to_meta(t, mut);
        if (keep) l.push_back(std::move(m));
      }
      call.key.add(static_cast<int64_t>(list.size()));
      if (keep) out.emplace_back(c10::List<at::Tensor>(l));
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> l;
      for (const auto& e : v.toOptionalTensorList()) {
        ++call.element;
        std::optional<at::Tensor> ot = e;
        std::optional<at::Tensor> m = ot ? std::optional<at::Tensor>(call.to_meta(*ot, mut)) : std::nullopt;
        if (keep) l.push_back(std::move(m));
        if (!ot) call.key.add(-3);
      }
      call.key.add(static_cast<int64_t>(call.element + 1));  // the list's length
      if (keep) out.emplace_back(l);
    } else if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) {
      check_device_index(v.toDevice().index());
      call.device = std::max<c10::DeviceIndex>(v.toDevice().index(), 0);
      call.key.add(-4);
      if (keep) out.emplace_back(c10::Device(call.cpu_twins ? c10::kCPU : c10::kMeta));
    } else if (v.isGenerator()) {
      call.key.add(-5);
      // Meta kernels draw nothing; CPU twins draw from a throwaway generator.
      if (keep && call.cpu_twins) out.emplace_back(at::make_generator<at::CPUGeneratorImpl>(0));
      else if (keep) out.emplace_back();
    } else {
      if (i < 32 && ((call.scale_args >> i) & 1) && v.isDouble()) call.key.add_scale(v.toDouble());
      else call.key.add_ivalue(v);
      if (keep) out.push_back(v);
    }
  }
  return out;
}

// Runs the op on Meta tensors and describes its results.
thread_local bool inferring = false;

MetaResult infer(const c10::OperatorHandle& op, std::vector<c10::IValue> margs, Call& call) {
  torch::jit::Stack s(std::move(margs));
  for (const auto& v : s)
    for_each_tensor(v, [&](const at::Tensor& t) {
      // Every mgpu tensor has a twin by now; one that got through (an
      // argument of a kind the walk does not know) would record again,
      // from inside this inference, without end.
      TORCH_CHECK_NOT_IMPLEMENTED(!is_mgpu(t), "mgpu: an argument of ", op.schema().name(), " has no Meta twin");
    });
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    const bool was = inferring;
    inferring = true;
    struct Restore {
      bool was;
      ~Restore() { inferring = was; }
    } restore{was};
    op.callBoxed(&s);
  }
  MetaResult r;
  auto describe = [&](const at::Tensor& t) {
    MetaTensor mt;
    mt.defined = t.defined();
    if (!mt.defined) return mt;
    mt.geom = geometry_of(t);
    auto* impl = t.storage().unsafeGetStorageImpl();
    for (size_t k = 0; k < call.meta.size(); ++k)
      if (call.meta[k].unsafeGetStorageImpl() == impl) mt.alias = static_cast<int>(k);
    mt.nbytes = t.storage().nbytes();
    return mt;
  };
  for (const auto& v : s) {
    MetaReturn ret;
    if (v.isTensor()) {
      r.tensors.push_back(describe(v.toTensor()));
    } else if (v.isTensorList()) {
      ret.kind = MetaReturn::Kind::TensorList;
      ret.count = 0;
      for (const auto& t : v.toTensorList()) {
        r.tensors.push_back(describe(t));
        ++ret.count;
      }
    } else if (v.isNone()) {
      ret.kind = MetaReturn::Kind::None;
      ret.count = 0;
    } else {
      TORCH_CHECK_NOT_IMPLEMENTED(false, "mgpu: unexpected non-tensor result from ", op.schema().name());
    }
    r.returns.push_back(ret);
  }
  for (size_t k = 0; k < call.mutated_meta.size(); ++k) {
    const auto& m = call.mutated_meta[k];
    auto* impl = m.storage().unsafeGetStorageImpl();
    int idx = call.index_at(call.mutated_slots[k]);
    TORCH_CHECK_NOT_IMPLEMENTED(impl == call.meta[idx].unsafeGetStorageImpl(),
                                "mgpu: ", op.schema().name(), " rebinds a tensor to another storage");
    r.mutated_geom.push_back(geometry_of(m));
    r.mutated_nbytes.push_back(call.meta[idx].nbytes());
  }
  return r;
}

// Ops whose Meta kernel is registered from Python (torch._meta_registrations:
// relu, where, convolution, index_select, layer and batch norm...) have none
// in a C++ program without Python. Their results' geometry comes from one
// CPU run per new signature over zero-filled twins of the inputs (zeros are
// valid data for any call: indices in range, offsets ordered), so that the
// op is recorded instead of run eagerly. Ops whose output shapes depend on
// the data are tagged and never get here. A global generator the op draws
// from (ops with no Generator argument) is put back as it was.
bool no_meta_kernel(const c10::Error& e) {
  const std::string msg = e.what_without_backtrace();
  return msg.find("from the 'Meta' backend") != std::string::npos ||
      msg.find("no fake impl or Meta kernel registered") != std::string::npos ||
      msg.find("_overrideable not implemented") != std::string::npos;  // convolution's composite on Meta
}

// The default CPU generator's state, put back when this is destroyed.
class CpuGeneratorRestored {
public:
  CpuGeneratorRestored() : gen_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    saved_ = gen_.get_state();
  }
  ~CpuGeneratorRestored() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(saved_);
  }
  CpuGeneratorRestored(const CpuGeneratorRestored&) = delete;
  CpuGeneratorRestored& operator=(const CpuGeneratorRestored&) = delete;

private:
  at::Generator gen_;
  at::Tensor saved_;
};

// The CPU kernel over zeros of the arguments' sizes and layouts: its
// warnings (eager's) go to `warned`.
MetaResult infer_without_meta(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, bool cpu_as_meta,
                              c10::WarningHandler& warned) {
  TORCH_CHECK_NOT_IMPLEMENTED(!cpu_as_meta, "mgpu: ", op.schema().name(), " has no Meta kernel");
  Call twins;
  twins.build_meta = true;
  twins.cpu_twins = true;
  auto targs = meta_arguments(op.schema(), args, twins);
  throwaway_generators(op.schema(), targs);
  c10::WarningUtils::WarningHandlerGuard to(&warned);
  std::optional<CpuGeneratorRestored> restored;
  if (op.hasTag(at::Tag::nondeterministic_seeded) && !has_generator_arg(op.schema())) restored.emplace();
  return infer(op, std::move(targs), twins);
}

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
  op.callBoxed(&s);
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
  op.callBoxed(&s);
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
  } catch (const std::exception&) {
    return false;  // Meta's layout stands
  }
}

// Ops whose CPU kernels lay results out by their inputs' strides alone
// (TensorIterator's): the pointwise ones, and a few TensorIterator kernels
// PyTorch does not tag so.
bool follows_iterator_layout(const c10::OperatorHandle& op) {
  if (op.hasTag(at::Tag::pointwise)) return true;
  const auto& n = op.schema().name();
  return n == "aten::floor_divide" || n == "aten::complex" || n == "aten::polar";
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

// An error's message without its backtrace: c10::Error, or a plain
// std::runtime_error ("value cannot be converted to type c10::Half without
// overflow" comes as one).
std::string message_of(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error ? c10_error->what_without_backtrace() : e.what();
}

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
  // `uniform_(0, -42)`): a Generator argument, given or not, becomes a
  // throwaway one (throwaway_generators). Seeded ops with no Generator
  // argument (dropout) draw from the default CPU generator, which gets its
  // state back: the probe moves no generator the program can see (a draw
  // another thread makes from it during such a probe is undone).
  std::optional<CpuGeneratorRestored> restored;
  if (op.hasTag(at::Tag::nondeterministic_seeded) && !has_generator_arg(schema)) restored.emplace();
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
    } catch (const std::exception&) {
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
    } catch (const std::exception&) {
      std::rethrow_exception(on_zeros);  // zeros and ones alike: not the data
    }
    warned.take_over(std::move(on_ones));
    return true;
  }
  return false;
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

bool makes_sparse(const std::string& name) {
  for (const char* prefix : {"aten::to_sparse", "aten::_to_sparse", "aten::sparse_", "aten::_sparse_"})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

bool makes_nested(const std::string& name) {
  return name.rfind("aten::_nested_", 0) == 0 || name.rfind("aten::nested_", 0) == 0;
}

bool is_empty_factory(const c10::OperatorHandle& op) {
  const auto& n = op.schema().operator_name();
  return n.name == "aten::empty_strided" || (n.name == "aten::empty" && n.overload_name == "memory_format");
}

// An argument for the node: mgpu tensors become views of operands; CPU
// tensors are snapshotted (eager copies them at the call too).
struct NodeBuilder {
  Call& call;
  ir::Node& node;
  std::unordered_map<c10::TensorImpl*, ir::TensorRef> cpu_refs;
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
    auto it = cpu_refs.find(t.unsafeGetTensorImpl());
    if (it != cpu_refs.end()) {
      refs.emplace_back(it->second);
      return;
    }
    at::Tensor snap = t.clone(at::MemoryFormat::Contiguous);
    ir::TensorRef r{static_cast<int>(node.operands.size()), geometry_of(snap)};
    node.operands.push_back(ir::Value{ir::make_data(snap.storage()), 0});
    cpu_refs.emplace(t.unsafeGetTensorImpl(), r);
    refs.emplace_back(std::move(r));
  }
};

} // namespace

// What the capture hot path asks of an operator, worked out once per
// operator: its name ("aten::add.Tensor"), and the questions above. A call
// looks it up once (prepare_call) and hands it on.
struct OpInfo {
  std::string_view name;
  bool eager = false;          // needs_eager
  bool random = false;         // takes a Generator
  bool empty_factory = false;
  bool host_indices = false;   // indexing: indices come from the host
  bool host_batch_sizes = false;  // recurrent layers over packed sequences: batch sizes stay on the host
  bool thread_sensitive = false;  // its CPU kernel rounds by its thread count (Node::call_threads)
  bool aten = false;           // an aten op (others may have Python kernels)
  bool makes_quantized = false;  // quantize_per_tensor and friends
  bool batch_norm = false;     // native batch norm: eval mode saves nothing
  bool contiguous_result = false;  // eager allocates its result contiguous, whatever Meta says
  bool contiguous_if_complex = false;  // the same, where its first argument is complex
  bool nansum = false;         // canonical_dims: `dim=[]` means every dim
  bool makes_sparse = false;   // its name says it makes a sparse tensor
  bool makes_nested = false;   // its name says it makes (or reads) a nested tensor
  bool pointwise = false;      // tagged pointwise: reads no matmul precision
  // Bit i: argument i is a Scalar that only scales a term (add's and sub's
  // alpha, addcdiv's and addcmul's value): no result's shape, dtype or
  // error depends on a float's value there, so the signature keys it by
  // its class (0, 1, other), as the node hash does. An optimizer's update
  // (`p.add_(g, alpha=-lr)`, Adam's `addcdiv_(m, d, value=-step_size)`)
  // changes it every step: it would miss the signature cache each step,
  // and run the op's Meta kernel (in Python, for addcdiv_) each time.
  uint32_t scale_args = 0;
  mutable MetaCacheMemo last_signature;  // the cache entry its last call found
  // Per argument: 1 where it is a (optional) ScalarType, 2 a Layout, else 0
  // (refuse_unsupported reads those for quantized and sparse requests).
  std::vector<uint8_t> dtype_or_layout;
};

namespace {
const OpInfo& op_info(const c10::OperatorHandle& op) {
  static auto* infos = new std::unordered_map<const c10::FunctionSchema*, OpInfo>();
  const auto& schema = op.schema();
  auto it = infos->find(&schema);
  if (it != infos->end()) return it->second;
  static const std::unordered_set<std::string> host_indices = {
      "aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::_unsafe_index",
      "aten::_unsafe_index_put", "aten::index_fill", "aten::index_fill_"};
  std::string n = schema.operator_name().name;
  if (!schema.overload_name().empty()) n += "." + schema.overload_name();
  OpInfo info;
  info.name = ir::intern(n);
  info.eager = needs_eager(op);
  info.random = has_generator_arg(schema);
  info.empty_factory = is_empty_factory(op);
  info.host_indices = host_indices.count(schema.name()) > 0;
  // Measured: 1 and 2 intra-op threads give other bits for these CPU kernels
  // (test_conformance). Matrix products may too (MKL splits a long inner
  // dimension), but run on fewer threads by design: that is what lets
  // branches of products run side by side (docs/ARCHITECTURE.md).
  static const std::unordered_set<std::string> thread_sensitive = {
      "aten::native_layer_norm_backward", "aten::native_batch_norm", "aten::native_batch_norm_backward",
      "aten::_native_batch_norm_legit", "aten::_native_batch_norm_legit_functional",
      "aten::_native_batch_norm_legit_no_training", "aten::prod"};
  info.thread_sensitive = thread_sensitive.count(schema.name()) > 0;
  info.host_batch_sizes = schema.overload_name() == "data" &&
      (schema.name() == "aten::lstm" || schema.name() == "aten::gru" || schema.name() == "aten::rnn_tanh" ||
       schema.name() == "aten::rnn_relu");
  info.aten = n.rfind("aten::", 0) == 0;
  info.makes_quantized = schema.name().rfind("aten::quantize_per", 0) == 0 ||
      schema.name().rfind("aten::_make_per_", 0) == 0 || schema.name() == "aten::_empty_affine_quantized" ||
      schema.name() == "aten::_empty_per_channel_affine_quantized";
  // pow(Scalar, Tensor) allocates its result before it redispatches to
  // TensorIterator: contiguous in eager, the exponent's layout on Meta.
  // max_pool1d: see backend/cpu_paths.cpp (CPU's own kernel, contiguous).
  info.contiguous_result = n == "aten::pow.Scalar" || n == "aten::max_pool1d";
  // angle of a complex tensor: an empty result resized by angle.out
  // (contiguous); of a real one, TensorIterator's (the input's layout).
  info.contiguous_if_complex = n == "aten::angle";
  info.nansum = schema.name() == "aten::nansum";
  info.makes_sparse = makes_sparse(schema.name());
  info.makes_nested = makes_nested(schema.name());
  info.pointwise = !ir::reads_matmul_precision(op);
  static const std::unordered_set<std::string> scaling = {"aten::add",     "aten::add_",     "aten::sub",
                                                          "aten::sub_",    "aten::rsub",     "aten::addcdiv",
                                                          "aten::addcdiv_", "aten::addcmul", "aten::addcmul_"};
  if (scaling.count(schema.name()) > 0) {
    const auto& formals = schema.arguments();
    for (size_t i = 0; i < formals.size() && i < 32; ++i)
      if ((formals[i].name() == "alpha" || formals[i].name() == "value") &&
          formals[i].type()->kind() == c10::TypeKind::NumberType)
        info.scale_args |= uint32_t{1} << i;
  }
  for (const auto& a : schema.arguments()) {
    auto type = a.type();
    if (type->kind() == c10::TypeKind::OptionalType) type = type->castRaw<c10::OptionalType>()->getElementType();
    info.dtype_or_layout.push_back(type->kind() == c10::TypeKind::ScalarTypeType ? 1
                                   : type->kind() == c10::TypeKind::LayoutType  ? 2
                                                                                : 0);
  }
  info.batch_norm = schema.name() == "aten::native_batch_norm" || schema.name() == "aten::_native_batch_norm_legit" ||
      schema.name() == "aten::_native_batch_norm_legit_no_training";
  return infos->emplace(&schema, info).first->second;
}

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

// Attention and recurrent ops are tagged as seeded for their dropout: with
// a dropout probability of 0 they draw nothing, and their node needs no
// seed (a seeded node is not background-safe and stays out of tier 1:
// every transformer's scaled_dot_product_attention in eval or without
// attention dropout).
bool draws_nothing(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args) {
  const auto& formals = schema.arguments();
  for (size_t i = 0; i < args.size() && i < formals.size(); ++i) {
    const auto& name = formals[i].name();
    if ((name == "dropout_p" || name == "dropout") && args[i].isDouble()) return args[i].toDouble() == 0.0;
  }
  return false;
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
  if (!random && op.hasTag(at::Tag::nondeterministic_seeded) && !draws_nothing(schema, args))
    node->seed = draw_seed(std::nullopt);

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
      ir::Output out;
      out.nbytes = t.nbytes;
      out.returned = static_cast<int>(k);
      out.geom = t.geom;
      int out_index = static_cast<int>(node->outputs.size());
      node->outputs.push_back(out);
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
    ir::Output out;
    out.nbytes = nbytes;
    out.mutated_operand = idx;
    written_output[w] = static_cast<int>(node->outputs.size());
    node->outputs.push_back(out);
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

bool inferring_results() { return inferring; }

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

void check_same_device(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  check_same_device(op_info(op), op, args);
}

void check_same_device(const OpInfo& info, const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  // As on CUDA, indexing takes its indices from the host; a host tensor
  // indexed by mgpu indices is refused with CUDA's error.
  if (info.host_indices) {
    if (!args.empty() && args[0].isTensor() && args[0].toTensor().defined() && !is_mgpu(args[0].toTensor())) {
      bool mgpu_index = false;
      for (size_t i = 1; i < args.size(); ++i) mgpu_index = mgpu_index || holds_mgpu(args[i]);
      TORCH_CHECK(!mgpu_index, "indices should be either on cpu or on the same device as the indexed tensor (",
                  args[0].toTensor().device(), ")");
    }
    return;
  }
  bool any_mgpu = false;
  std::optional<c10::Device> other;
  const auto& schema = op.schema();
  for (size_t i = 0; i < args.size(); ++i) {
    // A PackedSequence keeps its batch sizes on the host, on every device.
    if (info.host_batch_sizes && i == 1) continue;
    // A 0-dim host tensor is a scalar the op reads; one it writes (an out=
    // tensor) is on another device, as on CUDA.
    const bool written = i < schema.arguments().size() && is_mutated(schema.arguments()[i]);
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (is_mgpu(t)) any_mgpu = true;
      else if (t.dim() > 0 || written || !t.device().is_cpu()) other = t.device();
    });
  }
  TORCH_CHECK(!(any_mgpu && other), "Expected all tensors to be on the same device, but found at least two devices, mgpu:0 and ",
              *other, "!");
}

namespace {

// Quantized, sparse and nested tensors have no mgpu form (the lazy storage holds
// plain strided bytes): refused at the call, by name, as a backend without
// such kernels refuses them.
void refuse_unsupported(const OpInfo& info, const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  const auto& schema = op.schema();
  bool quantized = info.makes_quantized;
  bool sparse = info.makes_sparse;
  bool nested = info.makes_nested;
  for (size_t i = 0; i < args.size(); ++i) {
    const uint8_t kind = i < info.dtype_or_layout.size() ? info.dtype_or_layout[i] : 0;
    if (kind == 1 && args[i].isInt())
      quantized = quantized || c10::isQIntType(static_cast<c10::ScalarType>(args[i].toInt()));
    if (kind == 2 && args[i].isInt())
      sparse = sparse || static_cast<c10::Layout>(args[i].toInt()) != c10::kStrided;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      quantized = quantized || t.is_quantized();
      sparse = sparse || t.layout() != c10::kStrided;
      nested = nested || t.is_nested();
    });
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!quantized, "mgpu: quantized tensors are not supported (", schema.name(),
                              "); quantize on the CPU: x.cpu()");
  TORCH_CHECK_NOT_IMPLEMENTED(!sparse, "mgpu: sparse tensors are not supported (", schema.name(),
                              "); use them on the CPU: x.cpu()");
  TORCH_CHECK_NOT_IMPLEMENTED(!nested, "mgpu: nested tensors are not supported (", schema.name(),
                              "); use them on the CPU: x.cpu(). nn.TransformerEncoder makes them in eval mode "
                              "when given a src_key_padding_mask: build it with enable_nested_tensor=False");
}

} // namespace

// nansum over `dim=[]` reduces every dim on CPU and CUDA, as sum does; its
// Meta kernel reduces none. The call is recorded as the `dim=None` it means.
// (Other Meta/CPU shape disagreements are caught by the probe of small
// calls, and at run time for large ones, as an error naming the op.)
void canonical_dims(const OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!info.nansum) return;
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  for (size_t i = 0; i < n; ++i) {
    auto& v = (*stack)[stack->size() - n + i];
    if (schema.arguments()[i].name() == "dim" && v.isIntList() && v.toIntList().empty()) v = c10::IValue();
  }
}

const OpInfo& prepare_call(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const OpInfo& info = op_info(op);
  type_tensor_lists(op.schema(), stack);
  canonical_dims(info, op, stack);
  refuse_unsupported(info, op, torch::jit::last(*stack, op.schema().arguments().size()));
  return info;
}

bool runs_eagerly(const OpInfo& info) { return info.eager; }

bool ignores_matmul_precision(const OpInfo& info) { return info.pointwise; }

int64_t full_probe_numel() {
  static const int64_t limit = ir::env::integer(ir::env::Var::FullProbeNumel, int64_t{1} << 14, 0);
  return limit;
}

} // namespace torch_mgpu::capture
