// A call's signature (the meta cache's key) and its Meta twins: one walk
// over the arguments (meta_arguments), and the helpers it shares.
#include "capture/record_steps.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>

namespace torch_mgpu::capture {

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

// Whether an argument is, or holds, an mgpu tensor.
bool holds_mgpu(const c10::IValue& v) {
  bool found = false;
  for_each_tensor(v, [&](const at::Tensor& t) { found = found || is_mgpu(t); });
  return found;
}

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

} // namespace torch_mgpu::capture
