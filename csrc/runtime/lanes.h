#pragma once
// CPU lanes: persistent worker threads, one per lane. A job runs on its
// lane's thread with that lane's share of the intra-op threads, so that k
// parallel lanes on C cores use C / k OpenMP and MKL threads each instead of
// oversubscribing the cores.
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace torch_mgpu::runtime {

class LanePool {
 public:
  static LanePool& instance();
  // Runs jobs[k] on lane thread k (growing the pool as needed), each with
  // `threads` intra-op threads; returns when all have returned.
  void run(const std::vector<std::function<void()>>& jobs, int threads);
  size_t size() const { return workers_.size(); }
  ~LanePool();

 private:
  struct Worker {
    std::thread thread;
    std::function<void()> job;
    bool has_job = false;
  };
  void loop(size_t k);
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::unique_ptr<Worker>> workers_;
  size_t pending_ = 0;
  int threads_ = 1;
  bool stop_ = false;
};

// Sets this thread's intra-op parallelism (OpenMP and MKL, thread-local).
void set_thread_parallelism(int threads);
int thread_parallelism();

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
