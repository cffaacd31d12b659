#include "runtime/host_cache.h"
#include "ir/env.h"
#include "ir/fork_order.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <pthread.h>

#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torch_mgpu::runtime {
namespace {

constexpr size_t kMinBytes = size_t(128) << 10;  // glibc's default mmap threshold
constexpr size_t kPage = 4096;

thread_local int t_scopes = 0;

struct Cache {
  std::mutex m;
  std::unordered_map<size_t, std::vector<void*>> free_blocks;  // by size
  std::unordered_map<void*, size_t> size_of;  // every block the cache made, in use or free
  size_t cached = 0;
  size_t limit = 0;
  int64_t hits = 0, misses = 0;
};

// Never destroyed: blocks may be freed by tensors that outlive static destruction.
Cache& cache() {
  static auto* c = [] {
    auto* c = new Cache();
    c->limit = static_cast<size_t>(ir::env::integer_or_fallback(ir::env::Var::HostCacheMb, 1024)) << 20;
    // A fork() taken while another thread holds the lock would leave it
    // locked in the child: hold it across the fork instead.
    ir::on_fork(ir::ForkRank::HostCache, [] { cache().m.lock(); }, [] { cache().m.unlock(); }, [] { cache().m.unlock(); });
    return c;
  }();
  return *c;
}

c10::Allocator* g_default = nullptr;  // PyTorch's CPU allocator, which serves everything else

void host_free(void* p) {
  if (!p) return;
  auto& c = cache();
  std::unique_lock<std::mutex> lock(c.m);
  auto it = c.size_of.find(p);
  if (it == c.size_of.end()) {
    lock.unlock();
    g_default->raw_deleter()(p);  // a block of the default allocator
    return;
  }
  const size_t n = it->second;
  if (c.cached + n <= c.limit) {
    c.free_blocks[n].push_back(p);
    c.cached += n;
    return;
  }
  c.size_of.erase(it);
  lock.unlock();
  c10::free_cpu(p);
}

struct CachingHostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto& c = cache();
    if (t_scopes == 0 || n < kMinBytes || c.limit == 0) return g_default->allocate(n);
    const size_t size = (n + kPage - 1) / kPage * kPage;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(c.m);
      auto it = c.free_blocks.find(size);
      if (it != c.free_blocks.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        c.cached -= size;
        ++c.hits;
      } else {
        ++c.misses;
      }
    }
    if (!p) {
      p = c10::alloc_cpu(size);
      std::lock_guard<std::mutex> lock(c.m);
      c.size_of[p] = size;
    }
    return {p, p, &host_free, c10::Device(c10::kCPU)};
  }
  // Frees blocks of either kind (see host_free), as raw_deallocate needs.
  c10::DeleterFnPtr raw_deleter() const override { return &host_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// Installed at load, over PyTorch's own default CPU allocator only (another
// allocator someone installed stays as it is).
const bool g_installed = [] {
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != c10::GetDefaultCPUAllocator() || current->raw_deleter() == nullptr) return false;
  g_default = current;
  cache();
  // Never destroyed: tensors may be allocated and freed during exit.
  c10::SetCPUAllocator(new CachingHostAllocator(), /*priority=*/1);
  return true;
}();

} // namespace

HostCacheScope::HostCacheScope() { ++t_scopes; }
HostCacheScope::~HostCacheScope() { --t_scopes; }

HostCacheStats host_cache_stats() {
  auto& c = cache();
  std::lock_guard<std::mutex> lock(c.m);
  return {static_cast<int64_t>(c.cached), c.hits, c.misses};
}

void host_cache_empty() {
  auto& c = cache();
  std::vector<void*> blocks;
  {
    std::lock_guard<std::mutex> lock(c.m);
    for (auto& [size, list] : c.free_blocks)
      for (void* p : list) {
        blocks.push_back(p);
        c.size_of.erase(p);
      }
    c.free_blocks.clear();
    c.cached = 0;
  }
  for (void* p : blocks) c10::free_cpu(p);
}

} // namespace torch_mgpu::runtime
