#include "runtime/sanitizer.h"
#include "ir/fork_order.h"

#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

namespace torch_mgpu::runtime {

namespace {

using Clock = std::vector<uint64_t>;  // by stream slot

uint64_t at(const Clock& c, size_t k) { return k < c.size() ? c[k] : 0; }
void join(Clock& a, const Clock& b) {
  if (a.size() < b.size()) a.resize(b.size(), 0);
  for (size_t k = 0; k < b.size(); ++k) a[k] = std::max(a[k], b[k]);
}

struct Access {
  int stream = 0;  // slot
  uint64_t epoch = 0;
  std::string what;
};

struct Buffer {
  std::optional<Access> write;  // the last
  std::vector<Access> reads;    // since it, the latest per stream
  int home = 0;                 // the stream it was allocated on (slot)
  std::set<int> recorded;       // recordDataPtrOnStream
};

constexpr size_t kMaxRaces = 200;

struct Sanitizer {
  std::atomic<bool> on{false};
  std::mutex m;
  std::unordered_map<c10::StreamId, int> slot_of;
  std::vector<c10::StreamId> stream_of;
  std::vector<Clock> clock;  // per slot
  // What every host thread knows finished: runs that completed (their
  // lanes' synchronizes) and blocking copies, which the executor hands to
  // the lanes under its lock. A lane's own synchronize is known to its
  // thread only (thread_host) until the run completes: another lane's
  // work must not count on it.
  Clock global;
  Clock pending;  // lanes' host clocks, joined into `global` when the run completes
  uint64_t generation = 0;
  int64_t accesses = 0;  // checked since the start
  std::unordered_map<const void*, Clock> events;
  std::unordered_map<const void*, double> event_time;
  std::unordered_map<const void*, Buffer> buffers;
  std::vector<std::string> races;
  std::set<std::string> seen;

  void reset() {
    slot_of.clear();
    stream_of.clear();
    clock.clear();
    global.clear();
    pending.clear();
    ++generation;
    events.clear();
    event_time.clear();
    buffers.clear();
    races.clear();
    seen.clear();
    accesses = 0;
    slot(0);  // the default stream
  }

  int slot(c10::StreamId id) {
    auto [it, fresh] = slot_of.try_emplace(id, static_cast<int>(stream_of.size()));
    if (fresh) {
      stream_of.push_back(id);
      clock.emplace_back();
    }
    return it->second;
  }

  std::string name(int s) const { return "stream " + std::to_string(stream_of[s]); }

  void race(const void* buffer, const Access& earlier, const char* earlier_kind, const std::string& later,
            const char* why) {
    std::ostringstream os;
    os << "stream-order race on buffer " << buffer << ": " << earlier_kind << " by " << earlier.what << " on "
       << name(earlier.stream) << ", then " << later << " " << why;
    std::string msg = os.str();
    if (races.size() < kMaxRaces && seen.insert(msg).second) races.push_back(std::move(msg));
  }

  // Access `a` happened before work whose clock is `c`.
  static bool before(const Access& a, const Clock& c) { return a.epoch <= at(c, a.stream); }

  void access(int s, const Clock& here, const std::string& what, const std::vector<const void*>& reads,
              const std::vector<const void*>& writes) {
    Clock& c = clock[s];
    join(c, global);  // queued after everything this host thread knows has finished
    join(c, here);
    if (c.size() <= static_cast<size_t>(s)) c.resize(s + 1, 0);
    const Access now{s, ++c[s], what};
    ++accesses;
    const std::string later_read = "read by " + what + " on " + name(s);
    const std::string later_write = "write by " + what + " on " + name(s);
    const char* why = "with no event or synchronize between them";
    for (const void* p : reads) {
      if (!p) continue;
      Buffer& b = buffers[p];
      if (b.write && !before(*b.write, c)) race(p, *b.write, "write", later_read, why);
      // One read per stream is kept, the latest: an earlier read on that
      // stream is ordered before anything the latest one is ordered before.
      auto same = std::find_if(b.reads.begin(), b.reads.end(), [&](const Access& r) { return r.stream == s; });
      if (same != b.reads.end()) *same = now;
      else b.reads.push_back(now);
    }
    for (const void* p : writes) {
      if (!p) continue;
      Buffer& b = buffers[p];
      if (b.write && !before(*b.write, c)) race(p, *b.write, "write", later_write, why);
      for (const auto& r : b.reads)
        if (!before(r, c)) race(p, r, "read", later_write, why);
      b.reads.clear();
      b.write = now;
    }
  }

  void allocated(const void* p, c10::StreamId current) {
    // The host allocator under the wrapper hands an address freed on one
    // stream to any stream; the caching allocator would not (it reuses a
    // block on its own stream, after the streams recorded on it). So the
    // check is made at the free, and a new block starts with no history.
    Buffer b;
    b.home = slot(current);
    // The caching allocator hands a block to its stream's later work: a use
    // on another stream must be ordered after where the home stream was.
    const uint64_t at_home = at(clock[b.home], b.home);
    if (at_home > 0) b.write = Access{b.home, at_home, "its allocation on " + name(b.home)};
    buffers[p] = std::move(b);
  }

  void freed(const void* p, const Clock& here) {
    auto it = buffers.find(p);
    if (it == buffers.end()) return;
    const Buffer& b = it->second;
    // Reusable by work queued on its own stream from now on, once the
    // streams recorded on it reach where they are now.
    Clock c = clock[b.home];
    join(c, global);
    join(c, here);
    for (int r : b.recorded) join(c, clock[r]);
    const std::string later = "its free (the block belongs to " + name(b.home) + ")";
    const char* why = "while that stream may still use it (no recordDataPtrOnStream and no synchronize)";
    if (b.write && !before(*b.write, c)) race(p, *b.write, "write", later, why);
    for (const auto& r : b.reads)
      if (!before(r, c)) race(p, r, "read", later, why);
    buffers.erase(it);
  }
};

Sanitizer& state() {
  static auto* s = new Sanitizer();  // leaked: frees may come during static teardown
  return *s;
}

// What this host thread learned of the streams (its synchronizes and
// queries), for the sanitizer's current run. Under the sanitizer's lock.
Clock& thread_host(Sanitizer& s) {
  thread_local uint64_t generation = 0;
  thread_local Clock c;
  if (generation != s.generation) {
    generation = s.generation;
    c.clear();
  }
  return c;
}

double host_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

thread_local c10::StreamId t_current = 0;

// The CPU device with streams: a per-thread current stream; events and
// waits go to the sanitizer. Kernels run when queued, so every query says
// done.
struct CpuStreams final : c10::impl::DeviceGuardImplInterface {
  mutable std::atomic<c10::StreamId> next_stream{1};
  mutable std::atomic<intptr_t> next_event{0};

  c10::DeviceType type() const override { return c10::DeviceType::CPU; }
  c10::Device exchangeDevice(c10::Device) const override { return c10::Device(c10::kCPU); }
  c10::Device getDevice() const override { return c10::Device(c10::kCPU); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  static c10::Stream make(c10::StreamId id) { return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCPU), id); }
  c10::Stream getStream(c10::Device) const override { return make(t_current); }
  c10::Stream getDefaultStream(c10::Device) const override { return make(0); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override { return make(next_stream++); }
  c10::Stream getNewStream(c10::Device, int) const override { return make(next_stream++); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = make(t_current);
    t_current = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (!*event) *event = reinterpret_cast<void*>(++next_event);
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    s.events[*event] = s.clock[s.slot(stream.id())];
    s.event_time[*event] = host_seconds();
  }
  void block(void* event, const c10::Stream& stream) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    auto it = s.events.find(event);
    if (it != s.events.end()) join(s.clock[s.slot(stream.id())], it->second);
  }
  void host_learns_event(void* event) const {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    auto it = s.events.find(event);
    if (it != s.events.end()) join(thread_host(s), it->second);
  }
  void host_learns_stream(const c10::Stream& stream) const {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    const int slot = s.slot(stream.id());
    join(thread_host(s), s.clock[slot]);
  }
  bool queryEvent(void* event) const override {
    host_learns_event(event);
    return true;
  }
  void synchronizeEvent(void* event) const override { host_learns_event(event); }
  bool queryStream(const c10::Stream& stream) const override {
    host_learns_stream(stream);
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override { host_learns_stream(stream); }
  void synchronizeDevice(const c10::DeviceIndex) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    for (const auto& c : s.clock) join(thread_host(s), c);
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    s.events.erase(event);
    s.event_time.erase(event);
  }
  double elapsedTime(void* a, void* b, const c10::DeviceIndex) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    auto ia = s.event_time.find(a), ib = s.event_time.find(b);
    TORCH_CHECK(ia != s.event_time.end() && ib != s.event_time.end(), "elapsedTime: an event was not recorded");
    return (ib->second - ia->second) * 1000.0;
  }
  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream) const override {
    if (!data.get()) return;
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    const int slot = s.slot(stream.id());
    s.buffers[data.get()].recorded.insert(slot);
  }
};

// Wraps the CPU allocator: each block's allocation (on the current stream)
// and free go to the sanitizer. Its pointers stay simple (context = data,
// one deleter) since code such as oneDNN's allocates raw; the inner
// allocator's DataPtr is kept aside until the free.
struct TrackingAllocator final : c10::Allocator {
  c10::Allocator* inner = nullptr;
  std::mutex m;
  std::unordered_map<void*, c10::DataPtr> blocks;

  static TrackingAllocator* self;

  static void free_block(void* p) {
    c10::DataPtr inner_block;
    {
      std::lock_guard<std::mutex> lock(self->m);
      auto it = self->blocks.find(p);
      if (it == self->blocks.end()) {
        // Allocated raw before the start (a raw free reaches whichever
        // allocator is installed now): the inner allocator's.
        if (auto raw = self->inner->raw_deleter()) raw(p);
        return;
      }
      inner_block = std::move(it->second);
      self->blocks.erase(it);
    }
    auto& s = state();
    if (s.on.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(s.m);
      s.freed(p, thread_host(s));
    }
    // inner_block's own deleter runs here, outside both locks.
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = inner->allocate(n);
    void* p = d.get();
    if (!p) return d;
    const c10::Device device = d.device();
    {
      std::lock_guard<std::mutex> lock(m);
      auto [it, fresh] = blocks.try_emplace(p);
      // An entry already there is stale: its block was freed raw after a
      // stop, by the inner allocator (which now hands the address out again).
      if (!fresh) (void)it->second.release_context();
      it->second = std::move(d);
    }
    auto& s = state();
    if (s.on.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(s.m);
      s.allocated(p, t_current);
    }
    return c10::DataPtr(p, p, &free_block, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
TrackingAllocator* TrackingAllocator::self = nullptr;

struct Installed {
  std::mutex m;
  CpuStreams* streams = nullptr;  // leaked once made: the registry does not own it
  TrackingAllocator* allocator = nullptr;
  const c10::impl::DeviceGuardImplInterface* saved_guard = nullptr;
  c10::Allocator* saved_allocator = nullptr;
};

Installed& installed() {
  static auto* i = new Installed();
  return *i;
}

constexpr uint8_t kAllocatorPriority = 2;  // above the host cache's (host_cache.cpp)

// fork() while another thread holds one of these would leave it held in the
// child, where the allocator wrapper's frees take it.
const bool g_atfork_registered = [] {
  ir::on_fork(
      ir::ForkRank::Sanitizer,
      [] {
        state().m.lock();
        if (TrackingAllocator::self) TrackingAllocator::self->m.lock();
      },
      [] {
        if (TrackingAllocator::self) TrackingAllocator::self->m.unlock();
        state().m.unlock();
      },
      [] {
        if (TrackingAllocator::self) TrackingAllocator::self->m.unlock();
        state().m.unlock();
      });
  return true;
}();

} // namespace

bool stream_sanitizer_on() { return state().on.load(std::memory_order_relaxed); }

void report_stream_access(c10::Device device, std::string_view what, const std::vector<const void*>& reads,
                          const std::vector<const void*>& writes, bool synchronous) {
  auto& s = state();
  // Only CPU streams are the sanitizer's: a real device's events and waits
  // go to its own backend, which the sanitizer does not see.
  if (!s.on.load(std::memory_order_relaxed) || !device.is_cpu()) return;
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  std::lock_guard<std::mutex> lock(s.m);
  const int slot = s.slot(stream.id());
  s.access(slot, thread_host(s), std::string(what), reads, writes);
  if (synchronous) join(s.global, s.clock[slot]);  // complete on return, and handed out under the executor's lock
}

void report_lane_done() {
  auto& s = state();
  if (!s.on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(s.m);
  join(s.pending, thread_host(s));
}

void report_run_done() {
  auto& s = state();
  if (!s.on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(s.m);
  join(s.global, s.pending);
  s.pending.clear();
}

void report_host_read(const void* buffer, std::string_view what) {
  auto& s = state();
  if (!s.on.load(std::memory_order_relaxed) || !buffer) return;
  std::lock_guard<std::mutex> lock(s.m);
  auto it = s.buffers.find(buffer);
  Clock known = s.global;
  join(known, thread_host(s));
  if (it == s.buffers.end() || !it->second.write || Sanitizer::before(*it->second.write, known)) return;
  s.race(buffer, *it->second.write, "write", "read by the host (" + std::string(what) + ")",
         "before a synchronize of that stream");
}

void start_stream_sanitizer() {
  auto& i = installed();
  std::lock_guard<std::mutex> lock(i.m);
  auto& s = state();
  TORCH_CHECK(!s.on.load(), "torch_mgpu: the stream sanitizer is already running");
  {
    std::lock_guard<std::mutex> state_lock(s.m);
    s.reset();
  }
  if (!i.streams) i.streams = new CpuStreams();
  if (!i.allocator) {
    i.allocator = new TrackingAllocator();
    TrackingAllocator::self = i.allocator;
  }
  i.saved_allocator = c10::GetAllocator(c10::DeviceType::CPU);
  i.allocator->inner = i.saved_allocator;
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CPU)];
  i.saved_guard = slot.exchange(i.streams);
  c10::SetAllocator(c10::DeviceType::CPU, i.allocator, kAllocatorPriority);
  t_current = 0;
  s.on.store(true);
}

std::vector<std::string> stop_stream_sanitizer() {
  auto& i = installed();
  std::lock_guard<std::mutex> lock(i.m);
  auto& s = state();
  if (!s.on.load()) return {};
  s.on.store(false);
  c10::SetAllocator(c10::DeviceType::CPU, i.saved_allocator, kAllocatorPriority);
  c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CPU)].store(i.saved_guard);
  t_current = 0;
  std::lock_guard<std::mutex> state_lock(s.m);
  auto out = s.races;
  s.reset();
  return out;
}

int64_t stream_sanitizer_accesses() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.m);
  return s.accesses;
}

std::vector<std::string> take_stream_sanitizer_races() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.m);
  auto out = std::move(s.races);
  s.races.clear();
  s.seen.clear();
  return out;
}

} // namespace torch_mgpu::runtime
