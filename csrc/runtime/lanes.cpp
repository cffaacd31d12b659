#include "runtime/lanes.h"

#include <ATen/Parallel.h>

extern "C" {
// Thread-local controls of the OpenMP runtime and MKL that ATen links;
// weak, so a build without them still loads.
void omp_set_num_threads(int) __attribute__((weak));
int omp_get_max_threads() __attribute__((weak));
int MKL_Set_Num_Threads_Local(int) __attribute__((weak));  // the C entry (the lower-case one is Fortran, by pointer)
}

namespace torch_mgpu::runtime {

void set_thread_parallelism(int threads) {
  if (omp_set_num_threads) omp_set_num_threads(threads);
  if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(threads);
}

int thread_parallelism() { return omp_get_max_threads ? omp_get_max_threads() : at::get_num_threads(); }

LanePool& instance_storage() {
  static auto* p = new LanePool();  // leaked: threads must outlive static teardown
  return *p;
}

LanePool& LanePool::instance() { return instance_storage(); }

LanePool::~LanePool() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_)
    if (w->thread.joinable()) w->thread.join();
}

void LanePool::loop(size_t k) {
  int applied = -1;
  while (true) {
    std::function<void()> job;
    int threads;
    {
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [&] { return stop_ || workers_[k]->has_job; });
      if (stop_) return;
      job = std::move(workers_[k]->job);
      threads = threads_;
    }
    if (threads != applied) {
      set_thread_parallelism(threads);
      applied = threads;
    }
    job();  // jobs catch their own exceptions
    {
      std::lock_guard<std::mutex> lock(m_);
      workers_[k]->has_job = false;
      --pending_;
    }
    done_cv_.notify_all();
  }
}

void LanePool::run(const std::vector<std::function<void()>>& jobs, int threads) {
  std::unique_lock<std::mutex> lock(m_);
  while (workers_.size() < jobs.size()) {
    size_t k = workers_.size();
    workers_.push_back(std::make_unique<Worker>());
    workers_[k]->thread = std::thread([this, k] { loop(k); });
  }
  threads_ = threads;
  pending_ = jobs.size();
  for (size_t k = 0; k < jobs.size(); ++k) {
    workers_[k]->job = jobs[k];
    workers_[k]->has_job = true;
  }
  cv_.notify_all();
  done_cv_.wait(lock, [&] { return pending_ == 0; });
}

} // namespace torch_mgpu::runtime
