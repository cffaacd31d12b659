// Meta inference: the call on Meta twins of its arguments (or on CPU twins
// of zeros where the op has no Meta kernel), its results described.
#include "capture/record_steps.h"

#include <optional>

namespace torch_mgpu::capture {
namespace {

using ir::Arg;
using ir::TensorGeometry;

// Runs the op on Meta tensors and describes its results.
thread_local bool inferring = false;

} // namespace

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
    // CPU twins (no Meta kernel): the CPU kernel, moving no generator.
    if (call.cpu_twins) call_drawing_nothing(op, s);
    else op.callBoxed(&s);
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
  return infer(op, std::move(targs), twins);
}

bool inferring_results() { return inferring; }

} // namespace torch_mgpu::capture
