#include "runtime/calibrate.h"

#include "runtime/lanes.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#ifdef TORCH_MGPU_USE_CUDA
#include <cuda_runtime_api.h>  // the SM count only (ATen/cuda/CUDAContext.h needs cuSPARSE headers)
#endif

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace torch_mgpu::runtime {

namespace {
template <typename F>
double median_seconds(F&& f, int reps) {
  std::vector<double> t;
  // Warm-up: the first few calls of an op with megabyte outputs pay page
  // faults (fresh mmap'd memory) until the allocator keeps such blocks,
  // 10-20x the steady cost; the steady cost is what the plans run at.
  for (int w = 0; w < 3; ++w) f();
  for (int r = 0; r < reps; ++r) {
    auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
// Data to measure on, from a generator of its own: drawing from the
// default generators moved the program's random numbers at its first plan
// (a program seeded before it drew other numbers after it).
at::Tensor measured_on(at::IntArrayRef sizes, c10::Device device = c10::kCPU) {
  at::Tensor t = at::randn(sizes, at::make_generator<at::CPUGeneratorImpl>(0));
  return device.is_cpu() ? t : t.to(device);
}
} // namespace

plan::CostModel calibrate_cpu(int cores) {
  plan::CostModel cm;
  at::AutoDispatchBelowADInplaceOrView guard;
  const int restore = at::get_num_threads();
  auto big = measured_on({384, 384});
  auto small = measured_on({128, 128});
  auto vec = measured_on({1 << 19});
  auto tiny = measured_on({4});

  set_thread_parallelism(1);
  double t_big1 = median_seconds([&] { at::mm(big, big); }, 5);
  double t_small = median_seconds([&] { at::mm(small, small); }, 9);
  // Elementwise rates into a preallocated output: a fresh megabyte output
  // costs page faults or not depending on the allocator's history in this
  // process (up to 20x), which made plans differ from run to run.
  auto out = at::empty_like(vec);
  double t_vec = median_seconds([&] { at::add_out(out, vec, vec); }, 7);
  double t_tanh = median_seconds([&] { at::tanh_out(out, vec); }, 5);
  double t_tiny = median_seconds([&] { at::add(tiny, tiny); }, 31);
  set_thread_parallelism(cores);
  double t_big_n = median_seconds([&] { at::mm(big, big); }, 5);
  double t_vec_n = median_seconds([&] { at::add_out(out, vec, vec); }, 7);
  set_thread_parallelism(restore);

  const double big_flops = 2.0 * 384 * 384 * 384, small_flops = 2.0 * 128 * 128 * 128;
  cm.gemm_flops_per_s = big_flops / t_big1;
  cm.small_gemm_flops_per_s = small_flops / t_small;
  cm.elem_per_s = (1 << 19) / t_vec;
  cm.transcendental_per_s = (1 << 19) / t_tanh;
  cm.bytes_per_s = 3.0 * 4 * (1 << 19) / t_vec;
  // Executor overhead: views, the boxed call, bookkeeping: about 2 tiny ops.
  cm.op_overhead_s = 2.0 * t_tiny;
  if (cores > 1 && !in_forked_child()) {
    double s_gemm = t_big1 / t_big_n, s_vec = t_vec / t_vec_n;
    double s = std::max(s_gemm, s_vec);
    cm.parallel_efficiency = std::clamp((s - 1.0) / (cores - 1), 0.0, 1.0);
    // Products as small as the 128 case run on one thread in eager.
    cm.parallel_min_flops = 2.0 * 160 * 160 * 160;
    std::vector<std::function<void()>> nop(static_cast<size_t>(cores), [] {});
    // Waking lanes that went to sleep is what a sync after a pause pays
    // (on a virtual machine a halted vCPU takes long to wake): measure that.
    LanePool::instance().run(nop, 1);
    std::vector<double> wake;
    for (int r = 0; r < 5; ++r) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      auto a = std::chrono::steady_clock::now();
      LanePool::instance().run(nop, 1);
      wake.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
    }
    std::sort(wake.begin(), wake.end());
    cm.launch_s = wake[wake.size() / 2];
    cm.lane_sync_s = std::max(5e-6, std::min(cm.launch_s / 4, 50e-6));
  }
  cm.calibrated = true;
  return cm;
}

plan::CostModel calibrate_device(c10::Device device) {
  plan::CostModel cm;
  at::AutoDispatchBelowADInplaceOrView guard;
  c10::DeviceGuard on(device);
  c10::impl::VirtualGuardImpl impl(device.type());
  auto sync = [&] { impl.getStream(device).synchronize(); };
  auto big = measured_on({2048, 2048}, device);
  auto small = measured_on({128, 128}, device);
  auto vec = measured_on({1 << 22}, device);
  auto tiny = measured_on({4}, device);
  auto host = measured_on({1 << 22});
  double t_big = median_seconds([&] { at::mm(big, big); sync(); }, 5);
  double t_small = median_seconds([&] { at::mm(small, small); sync(); }, 9);
  double t_vec = median_seconds([&] { at::add(vec, vec); sync(); }, 7);
  double t_tanh = median_seconds([&] { at::tanh(vec); sync(); }, 5);
  // Launch cost: many tiny ops queued back to back, per op.
  double t_tiny = median_seconds([&] { for (int k = 0; k < 32; ++k) at::add(tiny, tiny); sync(); }, 5) / 32;
  double t_h2d = median_seconds([&] { host.to(device); sync(); }, 5);
  cm.gemm_flops_per_s = 2.0 * 2048 * 2048 * 2048 / t_big;
  cm.small_gemm_flops_per_s = 2.0 * 128 * 128 * 128 / t_small;
  cm.elem_per_s = (1 << 22) / t_vec;
  cm.transcendental_per_s = (1 << 22) / t_tanh;
  cm.bytes_per_s = 3.0 * 4 * (1 << 22) / t_vec;
  cm.op_overhead_s = t_tiny;
  cm.transfer_bytes_per_s = 4.0 * (1 << 22) / t_h2d;
  cm.transfer_latency_s = 10e-6;
  cm.lane_sync_s = 10e-6;  // an event record and wait
  // Products below this size run at the small-product rate.
  cm.parallel_min_flops = 2.0 * 512 * 512 * 512;
  cm.parallel_efficiency = 0;  // no intra-op threads: the device is the parallelism
#ifdef TORCH_MGPU_USE_CUDA
  // Its streams share its SMs (plan/topology.h, device_fill): the rates
  // above come from kernels that fill it, and a small product runs at its
  // fill's share of them, not at a rate of its own.
  int sms = 0;
  if (device.is_cuda() &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device.has_index() ? device.index() : 0) ==
          cudaSuccess &&
      sms > 0) {
    cm.sms = sms;
    cm.small_gemm_flops_per_s = cm.gemm_flops_per_s;
    cm.parallel_min_flops = 0;
  }
#endif
  cm.calibrated = true;
  return cm;
}

} // namespace torch_mgpu::runtime
