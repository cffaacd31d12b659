// A branchy program: a sum of independent matrix-product branches. No thread
// or stream appears in it; the plan spreads the branches over the lanes.
#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include <iostream>
#include <set>
#include <vector>

int main() {
  torch_mgpu::init();
  // Two lanes, whatever the core count, and the list-scheduling policy:
  // "auto" (the default) keeps one lane unless the cost model predicts the
  // spread plan 5% faster, and on a 2-core machine one lane's GEMMs already
  // use both cores, so there that choice is the model's call.
  torch_mgpu::configure({"cpu"}, 2, "heft");
  torch::manual_seed(0);
  std::vector<torch::Tensor> xs;
  for (int k = 0; k < 8; ++k) xs.push_back(torch::randn({256, 256}));
  auto branches = [](const std::vector<torch::Tensor>& in) {
    auto f = torch::zeros({256, 256}, in[0].options());
    for (const auto& x : in) f = f + torch::tanh(x.matmul(x));
    return f;
  };
  std::vector<torch::Tensor> xm;
  for (const auto& x : xs) xm.push_back(x.to(torch::Device("mgpu")));
  auto got = branches(xm).to(torch::kCPU);
  auto plan = torch_mgpu::last_plan();
  std::set<std::string> lanes;
  for (const auto& e : plan.timeline) lanes.insert(e.lane);
  std::cout << plan.text << "\n";
  std::cout << "lanes used: " << lanes.size() << " of " << torch_mgpu::lanes().size() << "\n";
  const bool same = torch::allclose(got, branches(xs), 1e-5, 1e-5);
  std::cout << (same ? "equals eager\n" : "DIFFERS FROM EAGER\n");
  return same && lanes.size() >= 2 ? 0 : 1;
}
