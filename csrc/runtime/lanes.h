#pragma once
// CPU lanes: the calling thread runs the first lane, persistent worker
// threads run the others. A job runs with its lane's share of the intra-op
// threads, so that k parallel lanes on C cores use C / k OpenMP and MKL
// threads each instead of oversubscribing the cores.
//
// Waking a sleeping thread can cost hundreds of microseconds on a virtual
// machine (its vCPU halts), so an idle worker spins for a short while
// (TORCH_MGPU_SPIN_US, default 300) before it sleeps: back-to-back syncs, as
// in a training loop, then find their lanes awake.
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <chrono>
#include <thread>
#include <vector>

namespace torch_mgpu::runtime {

class LanePool {
 public:
  static LanePool& instance();
  // Runs jobs[0] on the calling thread and jobs[k] on worker k, each with
  // `threads` intra-op threads; returns when all have returned. Jobs must
  // not throw (a job that does ends the process: wrap it). One run at a
  // time: a second caller (calibration beside a flight) waits for the
  // first; a job must not call run().
  void run(const std::vector<std::function<void()>>& jobs, int threads);
  ~LanePool();

 private:
  struct Worker {
    std::thread thread;
    const std::function<void()>* job = nullptr;
    std::atomic<uint64_t> ticket{0};  // bumped for each new job
    uint64_t seen = 0;
  };
  void loop(Worker& w);
  // Locking: run_ is held for a whole run (and never while waiting for
  // anything but the run's own jobs); m_ guards workers_ and the wake-ups.
  std::mutex run_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<size_t> pending_{0};
  std::atomic<int> threads_{1};
  std::atomic<bool> stop_{false};
  int64_t spin_ns_ = 300000;
};

// Microseconds a waiting thread spins before it sleeps
// (TORCH_MGPU_SPIN_US, default 300): the lanes' and the background worker's.
int64_t spin_us();

// One step of a spin-wait: a pause instruction, and now and then a yield so
// that a spinning thread gives way when threads outnumber cores (a yield is
// a system call: yielding on every step costs more than the wait).
inline void spin_pause(uint32_t& step) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
  if ((++step & 1023u) == 0) std::this_thread::yield();
}

// The spin of a spin-then-sleep wait (the lanes', the background
// worker's, a wait for a flight): spin_pause while `waiting()` holds, for
// at most `ns` nanoseconds (the clock read every 64 steps). Returns
// whether the wait is over; if not, the caller sleeps on its condition.
template <class Waiting>
bool spin_while(Waiting waiting, int64_t ns) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  uint32_t step = 0;
  while (waiting() && ((step & 63u) != 0 || std::chrono::steady_clock::now() < until)) spin_pause(step);
  return !waiting();
}

// Whether this process is the child of a fork() made after the library
// loaded: its worker threads did not survive the fork, so plans run on the
// calling thread alone and nothing runs in the background.
bool in_forked_child();
// A forked child of a process that had started lane or background threads
// (torch.mgpu._is_in_bad_fork()): it runs plans on one lane, its own thread.
bool in_bad_fork();
void note_threads_started();

// Sets this thread's intra-op parallelism (OpenMP and MKL, thread-local).
void set_thread_parallelism(int threads);
int thread_parallelism();

// This thread lets go of its OpenMP team, if it made one (libgomp's
// omp_pause_resource_all; a no-op without it, and with LLVM's or Intel's
// runtime, whose pause is the whole process's). For mgpu's own threads when
// they go idle: libgomp counts every pooled team thread of the process, and
// while they outnumber the cores its waiting threads spin only briefly
// before they sleep, so every later multithreaded kernel of the process, on
// any thread, pays for waking its team (2x on a training step: see
// docs/EXECUTION.md, "OpenMP teams"). The program's threads keep theirs.
void release_thread_team();

// Sets this thread's intra-op parallelism for a scope.
struct ScopedParallelism {
  explicit ScopedParallelism(int threads) : saved_(thread_parallelism()) { set_thread_parallelism(threads); }
  ~ScopedParallelism() { set_thread_parallelism(saved_); }
  ScopedParallelism(const ScopedParallelism&) = delete;
  ScopedParallelism& operator=(const ScopedParallelism&) = delete;

 private:
  int saved_;
};

} // namespace torch_mgpu::runtime
