#pragma once
// The process-wide settings a kernel reads (CallState, node.h): read now, and
// put in place for the length of an execution.
#include "ir/node.h"

#include <c10/util/Exception.h>

namespace torch_mgpu::ir {

// The settings as they are now. Without `matmul_precision` that one is left
// at its default (reading it costs a hash-map lookup in ATen's context, ~2%
// of a tiny op's capture): for calls that never multiply matrices.
CallState current_call_state(bool matmul_precision = true);

// Whether the op's kernels may read the float32 matmul precision: every op
// but ATen's elementwise ones (the `pointwise` tag), which multiply no
// matrices. Capture does not read the precision for those (their nodes
// carry the pending ops'), and tier 1 does not count it as a setting of theirs.
bool reads_matmul_precision(const c10::OperatorHandle& op);

// Puts `state` in place where it differs from the current settings, and
// restores them when destroyed. The settings are process-wide: the guard is
// for the thread that runs a graph while the program waits for it (a sync),
// never for a background flight, which runs while the program goes on.
class CallStateGuard {
public:
  explicit CallStateGuard(const CallState& state);
  ~CallStateGuard();
  CallStateGuard(const CallStateGuard&) = delete;
  CallStateGuard& operator=(const CallStateGuard&) = delete;

private:
  CallState saved_;
  bool changed_ = false;
};

// A warning handler that drops every warning: for kernels run again where
// the call already warned (a graph's run, probes of a call).
c10::WarningHandler& silent_warnings();

} // namespace torch_mgpu::ir
