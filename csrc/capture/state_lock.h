#pragma once
// The engine's state lock and the rules that keep it deadlock-free beside an
// interpreter lock (Python's GIL). docs/ARCHITECTURE.md, "Locking", lists
// every lock of the engine and the order in which they may be taken.
//
// Locking: the state lock guards the lazy state (each LazyBuffer's value,
// the buffer registry, the meta cache, the background flight slot, the lane
// configuration). It is recursive (a storage can die on the thread that
// holds it). Python may run under it (Meta kernels registered from Python,
// custom ops' kernels), so a thread may take the GIL while it holds the
// state lock, and never the other way round: taking the state lock at the
// outermost level first lets go of the GIL if this thread holds it, and
// takes it back after the state lock is released. Storage deleters, which
// run wherever a tensor dies (with the GIL held, in Python), never wait for
// the state lock: when it is taken they leave the buffer to whoever holds
// it, which frees it before letting go.
#include <exception>
#include <mutex>

namespace torch_mgpu::capture {

struct LazyBuffer;

// How the host language's interpreter lock is let go of and taken back. The
// core library links no Python; the Python binding installs these at import.
struct InterpreterLock {
  bool (*held)() = nullptr;      // does this thread hold it?
  void* (*release)() = nullptr;  // lets go of it; returns what restore needs
  void (*restore)(void*) = nullptr;
  // Is this error the interpreter's own stop? (ir::is_interrupt)
  bool (*is_interrupt)(const std::exception&) = nullptr;
  // An error raised by Python code under a call that the caller handles
  // (by rerunning the op on the CPU): no longer this thread's pending one.
  void (*handled)(const std::exception&) = nullptr;
};
void set_interpreter_lock(const InterpreterLock& hooks);

// `e` (not an interrupt) is handled: see InterpreterLock::handled.
void error_handled(const std::exception& e);

// Holds the state lock for a scope (see above). Recursive.
class StateLock {
 public:
  StateLock();
  // Takes the lock only if that needs no waiting (it is free, or this thread
  // holds it already); owns() says whether it did.
  explicit StateLock(std::try_to_lock_t);
  ~StateLock();
  StateLock(const StateLock&) = delete;
  StateLock& operator=(const StateLock&) = delete;
  bool owns() const { return owns_; }

 private:
  bool owns_ = false;
  void* interpreter_ = nullptr;  // the interpreter lock let go of at the outermost level
};

// Whether this thread holds the state lock.
bool holds_state_lock();

// Lets go of the interpreter lock for a scope if this thread holds it: for a
// wait on another thread that may need it (a background flight that calls
// compiled code), from a thread that may hold it under the state lock
// (Python that runs under it and records an op).
class InterpreterRelease {
 public:
  InterpreterRelease();
  ~InterpreterRelease();
  InterpreterRelease(const InterpreterRelease&) = delete;
  InterpreterRelease& operator=(const InterpreterRelease&) = delete;

 private:
  void* interpreter_ = nullptr;
};

// A buffer whose storage died while another thread held the state lock: the
// holder frees it before releasing the lock.
void defer_free(LazyBuffer* b);
// Frees `b` now: the state lock is held.
void free_buffer(LazyBuffer* b);

} // namespace torch_mgpu::capture
