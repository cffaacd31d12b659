#include "capture/state_lock.h"
#include "ir/errors.h"

#include <atomic>
#include <vector>

namespace torch_mgpu::capture {

namespace {
std::recursive_mutex& state_mutex() {
  static auto* m = new std::recursive_mutex();  // leaked: used by deleters during exit
  return *m;
}

// How deep this thread holds the state lock.
thread_local int t_depth = 0;

InterpreterLock g_hooks;  // set once, at the binding's import, before any thread uses it

// Buffers left by deleters that found the lock taken. Its own small mutex,
// never held while anything else is taken or waited for.
std::mutex& deferred_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::vector<LazyBuffer*>& deferred() {
  static auto* v = new std::vector<LazyBuffer*>();
  return *v;
}
std::atomic<size_t> g_deferred{0};

void* release_interpreter() {
  if (g_hooks.held && g_hooks.held()) return g_hooks.release();
  return nullptr;
}

// Under the state lock, at the outermost level.
void drain_deferred() {
  while (g_deferred.load(std::memory_order_acquire) != 0) {
    std::vector<LazyBuffer*> batch;
    {
      std::lock_guard<std::mutex> lock(deferred_mutex());
      batch.swap(deferred());
      g_deferred.store(0, std::memory_order_release);
    }
    for (auto* b : batch) free_buffer(b);
  }
}
} // namespace

void set_interpreter_lock(const InterpreterLock& hooks) {
  g_hooks = hooks;
  ir::set_interrupt_test(hooks.is_interrupt);
}

void error_handled(const std::exception& e) {
  if (g_hooks.handled) g_hooks.handled(e);
}

bool holds_state_lock() { return t_depth > 0; }

// Only the outermost level takes the mutex: an inner one (an op at its call
// materializing its inputs, a sync inside a call) counts its depth and
// nothing else.
StateLock::StateLock() : owns_(true) {
  if (t_depth > 0) {
    ++t_depth;
    return;
  }
  interpreter_ = release_interpreter();
  state_mutex().lock();
  ++t_depth;
}

StateLock::StateLock(std::try_to_lock_t) {
  if (t_depth == 0 && !state_mutex().try_lock()) return;  // this thread holding it never waits
  owns_ = true;
  ++t_depth;
}

StateLock::~StateLock() {
  if (!owns_) return;
  if (t_depth > 1) {
    --t_depth;
    return;
  }
  drain_deferred();
  --t_depth;
  state_mutex().unlock();
  // A deleter may have deferred a buffer after the drain: free it if the
  // lock is free, else its holder will.
  while (t_depth == 0 && g_deferred.load(std::memory_order_acquire) != 0 && state_mutex().try_lock()) {
    ++t_depth;
    drain_deferred();
    --t_depth;
    state_mutex().unlock();
  }
  if (interpreter_) g_hooks.restore(interpreter_);
}

InterpreterRelease::InterpreterRelease() : interpreter_(release_interpreter()) {}
InterpreterRelease::~InterpreterRelease() {
  if (interpreter_) g_hooks.restore(interpreter_);
}

void defer_free(LazyBuffer* b) {
  std::lock_guard<std::mutex> lock(deferred_mutex());
  deferred().push_back(b);
  g_deferred.store(deferred().size(), std::memory_order_release);
}

} // namespace torch_mgpu::capture
