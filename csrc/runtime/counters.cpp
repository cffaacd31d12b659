#include "runtime/counters.h"

namespace torch_mgpu::runtime {

Counters& counters() {
  static Counters c;
  return c;
}

} // namespace torch_mgpu::runtime
