#include "runtime/lanes.h"
#include "ir/env.h"
#include "ir/fork_order.h"

#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <pthread.h>

#include <chrono>
#include <cstdlib>

extern "C" {
// Thread-local controls of the OpenMP runtime and MKL that ATen links;
// weak, so a build without them still loads.
void omp_set_num_threads(int) __attribute__((weak));
int omp_get_max_threads() __attribute__((weak));
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));  // the C entry (lower case is Fortran, by pointer)
int omp_pause_resource_all(int kind) __attribute__((weak));  // OpenMP 5.0; kind 1: omp_pause_soft
}

namespace torch_mgpu::runtime {

namespace {
std::atomic<bool> g_forked_child{false};
std::atomic<bool> g_threads_started{false};  // lane or background threads exist (or did, before a fork)
// fork() copies only the calling thread: in the child, the lane workers and
// the background worker do not exist.
const bool g_atfork_registered = [] {
  ir::on_fork(ir::ForkRank::ChildOnly, nullptr, nullptr, [] { g_forked_child.store(true); });
  return true;
}();
} // namespace

bool in_forked_child() { return g_forked_child.load(); }
void note_threads_started() { g_threads_started.store(true); }
bool in_bad_fork() { return g_forked_child.load() && g_threads_started.load(); }

void set_thread_parallelism(int threads) {
  if (omp_set_num_threads) omp_set_num_threads(threads);
  if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(threads);
}

void release_thread_team() {
  // libgomp's pause frees the calling thread's team only; LLVM's and
  // Intel's runtimes (which export __kmpc_*) pause the whole process's,
  // under the program's own threads: there it is left alone.
  static const bool own_team_only =
      omp_pause_resource_all != nullptr && dlsym(RTLD_DEFAULT, "__kmpc_fork_call") == nullptr;
  if (own_team_only) omp_pause_resource_all(/*omp_pause_soft=*/1);
}

int thread_parallelism() { return omp_get_max_threads ? omp_get_max_threads() : at::get_num_threads(); }

int64_t spin_us() {
  static const int64_t us = ir::env::integer_or_fallback(ir::env::Var::SpinUs, 300);
  return us;
}

LanePool& LanePool::instance() {
  static auto* p = [] {
    auto* pool = new LanePool();  // leaked: threads must outlive static teardown
    pool->spin_ns_ = spin_us() * 1000;
    return pool;
  }();
  return *p;
}

LanePool::~LanePool() {
  stop_ = true;
  {
    std::lock_guard<std::mutex> lock(m_);
  }
  cv_.notify_all();
  for (auto& w : workers_)
    if (w->thread.joinable()) w->thread.join();
}

// Each thread is handed its own Worker: the vector of workers may grow
// (and move its elements' pointers) while the thread starts.
void LanePool::loop(Worker& w) {
  pthread_setname_np(pthread_self(), "mgpu-lane");  // as `top -H`, perf and gdb show it
  int applied = -1;
  while (true) {
    // Spin a little for the next job, then sleep.
    if (!spin_while([&] { return w.ticket.load(std::memory_order_acquire) == w.seen && !stop_; }, spin_ns_)) {
      release_thread_team();  // idle: a team its lane's threads (or a node's) made goes
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [&] { return stop_ || w.ticket.load(std::memory_order_acquire) != w.seen; });
    }
    if (stop_) return;
    w.seen = w.ticket.load(std::memory_order_acquire);
    int threads = threads_.load();
    if (threads != applied) {
      set_thread_parallelism(threads);
      applied = threads;
    }
    (*w.job)();
    if (pending_.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lock(m_);
      done_cv_.notify_all();
    }
  }
}

void LanePool::run(const std::vector<std::function<void()>>& jobs, int threads) {
  if (jobs.empty()) return;
  // The workers of a forked parent are not here (plans in a forked child use
  // one lane, so this is a bug, reported rather than hung on).
  TORCH_CHECK(!in_forked_child() || jobs.size() == 1, "torch_mgpu: lanes cannot run in a forked child");
  const size_t extra = jobs.size() - 1;
  std::lock_guard<std::mutex> one_run(run_);
  {
    std::lock_guard<std::mutex> lock(m_);
    while (workers_.size() < extra) {
      // A worker joins the pool only once its thread runs (a failed spawn
      // throws here, before any job started, and leaves no idle slot).
      workers_.reserve(workers_.size() + 1);
      note_threads_started();
      auto w = std::make_unique<Worker>();
      Worker& worker = *w;
      worker.thread = std::thread([this, &worker] { loop(worker); });
      workers_.push_back(std::move(w));
    }
    threads_ = threads;
    pending_ = extra;
    for (size_t k = 0; k < extra; ++k) {
      workers_[k]->job = &jobs[k + 1];
      workers_[k]->ticket.fetch_add(1, std::memory_order_release);
    }
  }
  cv_.notify_all();
  std::exception_ptr error;
  try {
    ScopedParallelism share(threads);
    jobs[0]();
  } catch (...) {
    error = std::current_exception();  // rethrown once the workers are done with `jobs`
  }
  {
    std::unique_lock<std::mutex> lock(m_);
    done_cv_.wait(lock, [&] { return pending_.load() == 0; });
  }
  if (error) std::rethrow_exception(error);
}

} // namespace torch_mgpu::runtime
