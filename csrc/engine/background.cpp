// Background execution: every `async_ops()` recorded ops the pending graph
// becomes a flight, built, planned and executed by a background worker while
// capture goes on; the next flush or sync waits for it and binds it.
#include "ir/env.h"
#include "capture/capture.h"
#include "engine/execution.h"
#include "ir/call_state.h"
#include "runtime/lanes.h"
#include "runtime/counters.h"

#include <ATen/record_function.h>

#include <cxxabi.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace torch_mgpu {
namespace engine {
namespace {

// The background worker: runs one flight at a time. A waiting capture
// thread holds the state lock; the worker never takes it, and binding is done
// by whoever waits (see finish_flight).
class Worker {
 public:
  static Worker& instance() {
    static auto* w = new Worker();  // leaked: it may be needed during exit
    return *w;
  }
  void launch(std::shared_ptr<Execution> e) {
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = std::move(e);
      done_ = false;
      finished_.store(false);
      ticket_.fetch_add(1);
    }
    cv_.notify_one();
  }
  bool finished() const { return finished_.load(std::memory_order_acquire); }
  void wait() {
    // A flight is short: spin for it before sleeping (waking a sleeping
    // thread costs tens to hundreds of microseconds on a virtual machine).
    runtime::spin_while([&] { return !finished_.load(std::memory_order_acquire); }, spin_ns_ * 4);
    std::unique_lock<std::mutex> lock(m_);
    done_cv_.wait(lock, [&] { return done_; });
  }

 private:
  Worker() {
    spin_ns_ = runtime::spin_us() * 1000;
    runtime::note_threads_started();
    thread_ = std::thread([this] { loop(); });
    thread_.detach();
    // C++ programs that exit with a flight running wait for it first (not
    // a forked child: the worker, and any flight it ran, stayed behind).
    std::atexit([] {
      if (!runtime::in_forked_child()) Worker::instance().wait();
    });
  }
  void loop() {
    pthread_setname_np(pthread_self(), "mgpu-flights");  // as `top -H`, perf and gdb show it
    uint64_t seen = 0;
    while (true) {
      // Spin briefly before sleeping: flights come in quick succession.
      // Idle, it lets go of the team its kernels made (the calling thread's
      // owns the cores; runtime/lanes.h).
      if (!runtime::spin_while([&] { return ticket_.load() == seen; }, spin_ns_)) runtime::release_thread_team();
      std::shared_ptr<Execution> e;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return ticket_.load() != seen; });
        seen = ticket_.load();
        e = std::move(job_);  // the worker keeps nothing once done
      }
      try {
        e->run();
      } catch (abi::__forced_unwind&) {
        throw;  // the thread is being ended (pthread_exit): let it
      } catch (...) {
        // Building or planning failed before anything ran (e->ran is
        // false): the nodes stay pending, and the next sync plans them again
        // in the foreground and raises there.
      }
      e.reset();  // the waiting thread frees the graph (its nodes were allocated there)
      {
        std::lock_guard<std::mutex> lock(m_);
        done_ = true;
        finished_.store(true, std::memory_order_release);
      }
      done_cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::shared_ptr<Execution> job_;
  std::atomic<uint64_t> ticket_{0};
  bool done_ = true;
  std::atomic<bool> finished_{true};  // done_, readable without the lock
  int64_t spin_ns_ = 300000;
  std::thread thread_;
};

// Background execution state. Guarded by the state lock.
struct Background {
  std::shared_ptr<Execution> flight;   // running or finished, not yet bound
  std::exception_ptr error;            // first error of a bound flight, for the next sync
  int64_t since_flush = 0;             // ops recorded since the last flush
  bool blocked = false;                // a pending node must not run in the background
  int64_t threshold = ir::env::integer(ir::env::Var::AsyncOps, 256);
};
Background& background() {
  static auto* b = new Background();
  return *b;
}

} // namespace

void finish_flight() {
  auto& bg = background();
  if (!bg.flight) return;
  if (runtime::in_forked_child()) {
    // Forked while a flight ran: its worker is gone, and nothing of it was
    // bound here. Its nodes are still pending; the next sync runs them.
    bg.flight.reset();
    return;
  }
  auto t0 = clock::now();
  {
    // The flight may call compiled code, which takes the GIL: a thread that
    // holds it here (an op recorded by Python running under the state
    // lock) lets go of it while it waits.
    capture::InterpreterRelease let_go;
    Worker::instance().wait();
  }
  runtime::counters().background_wait_us += micros(t0, clock::now());
  auto e = std::move(bg.flight);
  bg.flight.reset();
  if (!e->ran) return;
  bind(*e);
  if (e->result.first_error && !bg.error) bg.error = e->result.first_error;
}

namespace {
// Whether the program's settings are still those the pending ops were
// called with: a flight runs under the settings as they are (setters wait
// for it; a sync puts a graph's own in place instead). An elementwise op
// reads no matmul precision and takes the pending ops' (record_call), so
// one recorded after the program changed it leaves the earlier products
// pending: those must not fly under the new precision.
bool under_own_settings(const std::vector<ir::Value>& roots) {
  const auto& node = roots.front().node;
  return !node || node->kind != ir::NodeKind::Op || node->state == ir::current_call_state();
}
} // namespace

bool flight_running() {
  auto& bg = background();
  if (!bg.flight) return false;
  if (runtime::in_forked_child() || Worker::instance().finished()) {
    finish_flight();  // done: binding it does not wait
    return false;
  }
  return true;
}

bool start_flight() {
  auto& bg = background();
  if (flight_running()) return true;
  if (bg.threshold <= 0 || bg.blocked || runtime::in_forked_child() || at::hasCallbacks()) return false;
  auto e = std::make_shared<Execution>();
  e->roots = pending_roots();
  if (e->roots.empty()) return true;
  if (!under_own_settings(e->roots)) return false;  // the caller syncs: under the graph's own
  bg.since_flush = 0;
  bg.flight = e;
  runtime::counters().background_flushes++;
  Worker::instance().launch(std::move(e));
  return true;
}

std::exception_ptr take_background_error() {
  auto& bg = background();
  bg.since_flush = 0;
  bg.blocked = false;  // the sync runs everything pending
  std::exception_ptr e = bg.error;
  bg.error = nullptr;
  return e;
}

void wait_for_flight() {
  capture::StateLock lock;
  finish_flight();
}

int64_t async_ops() {
  capture::StateLock lock;
  return background().threshold;
}

void set_async_ops(int64_t n) {
  TORCH_CHECK(n >= 0, "async_ops must be >= 0 (0 turns background execution off), got ", n);
  capture::StateLock lock;
  background().threshold = n;
}

void recorded(bool background_safe) {
  auto& bg = background();
  if (!background_safe) bg.blocked = true;
  if (bg.threshold <= 0 || ++bg.since_flush < bg.threshold || runtime::in_forked_child()) return;
  // Not under a profiler (its records belong to the lanes of a sync), and
  // not while a pending op draws from a global generator or may run Python
  // (the waiting thread holds the GIL).
  if (bg.blocked || at::hasCallbacks()) return;
  // Flights start every `threshold` ops whatever the timing (a busy worker
  // makes capture wait), so the same program cuts the same graphs and the
  // plan cache hits.
  bg.since_flush = 0;
  finish_flight();
  auto e = std::make_shared<engine::Execution>();
  e->roots = engine::pending_roots();
  if (e->roots.empty() || !under_own_settings(e->roots)) return;
  bg.flight = e;
  runtime::counters().background_flushes++;
  Worker::instance().launch(std::move(e));
}

} // namespace engine
} // namespace torch_mgpu
