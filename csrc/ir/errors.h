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

} // namespace torch_mgpu::ir
