// torch::nn modules trained with torch::optim::Adam on mgpu: an MLP and a
// small convolution net. Each is trained twice from the same seed, on CPU
// and on mgpu; the losses must agree step by step.
#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include <cmath>
#include <iostream>
#include <vector>

struct Mlp : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
  Mlp() {
    l1 = register_module("l1", torch::nn::Linear(32, 64));
    l2 = register_module("l2", torch::nn::Linear(64, 64));
    l3 = register_module("l3", torch::nn::Linear(64, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return l3(torch::relu(l2(torch::relu(l1(x))))); }
};

struct ConvNet : torch::nn::Module {
  torch::nn::Conv2d c1{nullptr}, c2{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
  ConvNet() {
    c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(8));
    c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(8 * 4 * 4, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn(c1(x))), 2);
    x = torch::max_pool2d(torch::relu(c2(x)), 2);
    return fc(x.flatten(1));
  }
};

template <typename Net>
std::vector<double> train(const torch::Device& device, const torch::Tensor& x, const torch::Tensor& y, int steps) {
  torch::manual_seed(1);
  auto net = std::make_shared<Net>();
  net->to(device);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  auto xd = x.to(device), yd = y.to(device);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(xd), yd);
    loss.backward();
    opt.step();
    losses.push_back(loss.item().toDouble());
  }
  return losses;
}

template <typename Net>
bool compare(const char* name, const torch::Tensor& x, const torch::Tensor& y) {
  const int steps = 8;
  auto cpu = train<Net>(torch::kCPU, x, y, steps);
  auto mgpu = train<Net>(torch::Device("mgpu"), x, y, steps);
  bool ok = true;
  for (int s = 0; s < steps; ++s) {
    const bool close = std::abs(cpu[s] - mgpu[s]) <= 1e-4 * std::max(1.0, std::abs(cpu[s]));
    ok = ok && close;
    std::cout << name << " step " << s << ": cpu " << cpu[s] << "  mgpu " << mgpu[s] << (close ? "" : "  <- differs")
              << "\n";
  }
  ok = ok && cpu.back() < cpu.front();  // it learns
  return ok;
}

int main() {
  torch_mgpu::init();
  torch::manual_seed(0);
  bool ok = compare<Mlp>("mlp", torch::randn({64, 32}), torch::randint(0, 10, {64}));
  ok = compare<ConvNet>("convnet", torch::randn({16, 3, 16, 16}), torch::randint(0, 10, {16})) && ok;
  std::cout << (ok ? "losses equal eager\n" : "LOSSES DIFFER\n");
  return ok ? 0 : 1;
}
