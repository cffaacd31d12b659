// The first program: record a few ops on mgpu, read the result, print the plan.
#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include <iostream>

int main() {
  torch_mgpu::init();  // "mgpu" parses as a device
  torch::manual_seed(0);
  auto a_cpu = torch::randn({512, 512});
  auto a = a_cpu.to(torch::Device("mgpu"));
  auto c = torch::relu(a.matmul(a)) + a;  // recorded
  std::cout << "pending ops: " << torch_mgpu::pending_ops() << "\n";
  auto sum = c.to(torch::kCPU).sum();  // materialized
  std::cout << "sum: " << sum.item<float>() << "\n";
  std::cout << torch_mgpu::last_plan().text << "\n";
  auto eager = (torch::relu(a_cpu.matmul(a_cpu)) + a_cpu).sum();
  if (!torch::allclose(sum, eager)) {
    std::cerr << "mgpu " << sum.item<float>() << " != eager " << eager.item<float>() << "\n";
    return 1;
  }
  std::cout << "equals eager\n";
  return 0;
}
