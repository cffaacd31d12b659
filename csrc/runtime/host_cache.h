#pragma once
// Host memory for the lanes. Large blocks that kernels allocate while a lane
// runs (outputs of megabytes) are kept when freed and handed out again for
// the same size, instead of going back to the OS: glibc returns such blocks
// (munmap, or trimming a thread's heap) and the next run pays a page fault
// per 4 KiB touching them again, which on a VM can cost more than the
// kernels (a k-NN step: 8,000 faults and ~11 ms a run).
//
// It is the process's CPU allocator (c10::SetCPUAllocator) but serves from
// the cache only on threads inside a HostCacheScope (lanes executing a
// plan, an op running at its call) and only blocks of 128 KiB and more; every other allocation goes to
// PyTorch's default allocator unchanged, so eager code is not affected.
// Freed cached blocks are kept up to TORCH_MGPU_HOST_CACHE_MB (default
// 1024; 0 turns the cache off); torch_mgpu.empty_cache() releases them.
#include <cstdint>

namespace torch_mgpu::runtime {

// While alive, this thread's large CPU allocations may come from the cache.
struct HostCacheScope {
  HostCacheScope();
  ~HostCacheScope();
  HostCacheScope(const HostCacheScope&) = delete;
  HostCacheScope& operator=(const HostCacheScope&) = delete;
};

struct HostCacheStats {
  int64_t cached_bytes = 0;  // freed blocks kept for reuse
  int64_t hits = 0;          // allocations served from them
  int64_t misses = 0;        // allocations in a scope that found none
};
HostCacheStats host_cache_stats();

// Returns every cached block to the system.
void host_cache_empty();

} // namespace torch_mgpu::runtime
