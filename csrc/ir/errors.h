#pragma once
// An error's message as it is shown again (in another error, a report, a
// message to another rank): c10's without its backtrace, else what().
#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace torch_mgpu::ir {

inline std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// The interpreter's own stop (Python's KeyboardInterrupt at a SIGINT,
// SystemExit) raised by Python code that ran under a call (a Meta kernel
// written in Python, compiled code's wrapper), rather than the call's error.
// The interpreter raises it once: it is never taken for an op's error (no
// fallback, no retry, no rewording), always passed on as it is. The Python
// binding installs the test (capture::set_interpreter_lock); without it,
// nothing is an interrupt.
void set_interrupt_test(bool (*test)(const std::exception&));
bool is_interrupt(const std::exception& e);
// In a handler that would take `e` for an op's error and go on (a fallback,
// a probe that tries again, tier 1 falling back to tier 0): rethrows the
// exception being handled if it is an interrupt.
void rethrow_if_interrupt(const std::exception& e);

} // namespace torch_mgpu::ir
