#pragma once
// Names the Python line that recorded an op (capture/caller.h's provider).
#include <string>
#include <vector>

namespace torch_mgpu::python {

// Installs the provider; frames of files under `internal_dirs` (torch's and
// torch_mgpu's packages) are passed over. Called at import, with the GIL.
void install_caller(std::vector<std::string> internal_dirs);

} // namespace torch_mgpu::python
