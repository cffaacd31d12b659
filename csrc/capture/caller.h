#pragma once
// Where the op being recorded was called from, so that an error raised at a
// sync can name the line that recorded the failing op. The host language
// installs a provider (Python: the innermost frame outside torch's own
// files); a C++ program has none, and errors name the op's index instead.
#include <string_view>

namespace torch_mgpu::capture {

// Returns an interned "file.py:12" (alive for the process), or empty.
// Called under the state lock: a provider may take the interpreter lock
// (see state_lock.h: the state lock first, then the GIL).
using CallerProvider = std::string_view (*)();
void set_caller_provider(CallerProvider provider);
// The caller of the op being recorded, or empty where none is known or
// TORCH_MGPU_CALLER=0 turned it off.
std::string_view caller_location();

} // namespace torch_mgpu::capture
