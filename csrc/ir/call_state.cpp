#include "ir/call_state.h"

#include <ATen/Context.h>
#include <c10/core/DefaultDtype.h>

namespace torch_mgpu::ir {

namespace {
void apply(const CallState& s) {
  auto& ctx = at::globalContext();
  c10::set_default_dtype(c10::scalarTypeToTypeMeta(s.default_dtype));
  ctx.setDeterministicAlgorithms(s.deterministic, s.deterministic_warn_only);
  ctx.setDeterministicFillUninitializedMemory(s.fill_uninitialized);
  static const char* const kPrecision[] = {"highest", "high", "medium"};
  const int p = s.matmul_precision;
  if (p >= 0 && p < 3 && static_cast<int>(ctx.float32MatmulPrecision()) != p) ctx.setFloat32MatmulPrecision(kPrecision[p]);
}
} // namespace

CallState current_call_state(bool matmul_precision) {
  const auto& ctx = at::globalContext();
  CallState s;
  s.default_dtype = c10::get_default_dtype_as_scalartype();
  s.deterministic = ctx.deterministicAlgorithms();
  s.deterministic_warn_only = ctx.deterministicAlgorithmsWarnOnly();
  s.fill_uninitialized = ctx.deterministicFillUninitializedMemory();
  if (matmul_precision) s.matmul_precision = static_cast<int8_t>(ctx.float32MatmulPrecision());
  return s;
}

bool reads_matmul_precision(const c10::OperatorHandle& op) {
  return op.schema().name().rfind("aten::", 0) != 0 || !op.hasTag(at::Tag::pointwise);
}

CallStateGuard::CallStateGuard(const CallState& state) : saved_(current_call_state()) {
  if (saved_ == state) return;
  changed_ = true;
  apply(state);
}

CallStateGuard::~CallStateGuard() {
  if (!changed_) return;
  try {
    apply(saved_);
  } catch (...) {
    // Restoring settings read a moment ago cannot fail; never throw here.
  }
}

c10::WarningHandler& silent_warnings() {
  struct Silent : c10::WarningHandler {
    void process(const c10::Warning&) override {}
  };
  static Silent h;
  return h;
}

} // namespace torch_mgpu::ir
