// The mgpu device from plain C++ (LibTorch, no Python, no TorchScript).
#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include <gtest/gtest.h>

TEST(Cpp, LazyOpsMatchEagerCpu) {
  torch::manual_seed(0);
  auto a = torch::randn({64, 64});
  auto b = torch::randn({64, 64});
  auto am = a.to(torch::Device("mgpu"));
  auto bm = b.to(torch_mgpu::device());
  auto c = (torch::mm(am, bm).relu() + am.sum(0)).t();
  EXPECT_GT(torch_mgpu::pending_ops(), 0);
  EXPECT_EQ(c.sizes(), (std::vector<int64_t>{64, 64}));
  EXPECT_TRUE(c.device().is_privateuseone());
  auto expected = (torch::mm(a, b).relu() + a.sum(0)).t();
  EXPECT_TRUE(torch::equal(c.cpu(), expected));
  EXPECT_EQ(torch_mgpu::pending_ops(), 0);
}

TEST(Cpp, InPlaceOnViews) {
  auto x = torch::arange(12, torch::kFloat).reshape({3, 4});
  auto xm = x.to(torch_mgpu::device());
  xm.slice(0, 1).add_(1);
  xm.t().mul_(2);
  x.slice(0, 1).add_(1);
  x.t().mul_(2);
  EXPECT_TRUE(torch::equal(xm.cpu(), x));
}

TEST(Cpp, SynchronizeAndPlan) {
  auto x = torch::randn({8, 8}).to(torch_mgpu::device());
  auto y = torch::tanh(torch::mm(x, x));
  torch_mgpu::synchronize();
  EXPECT_EQ(torch_mgpu::pending_ops(), 0);
  auto plan = torch_mgpu::last_plan();
  ASSERT_TRUE(plan.valid);
  EXPECT_EQ(plan.timeline.size(), 2u);
  EXPECT_EQ(plan.timeline[0].op, "aten::mm");
  auto stats = torch_mgpu::stats();
  EXPECT_GE(stats.at("ops_executed"), 2);
  EXPECT_GT(y.cpu().abs().sum().item<float>(), 0.0f);
}

TEST(Cpp, ErrorsAtTheCall) {
  auto a = torch::randn({3, 4}).to(torch_mgpu::device());
  auto b = torch::randn({5, 6}).to(torch_mgpu::device());
  EXPECT_THROW(torch::mm(a, b), c10::Error);
  EXPECT_THROW(torch_mgpu::device(7), c10::Error);
}

TEST(Cpp, BackgroundExecutionMatchesEager) {
  const int64_t before = torch_mgpu::async_ops();
  torch_mgpu::set_async_ops(16);
  auto x = torch::randn({32});
  auto xm = x.to(torch_mgpu::device());
  const int64_t flushes = torch_mgpu::stats().at("background_flushes");
  for (int k = 0; k < 100; ++k) {
    x = (x * 1.01).add_(0.01);
    xm = (xm * 1.01).add_(0.01);
  }
  EXPECT_GE(torch_mgpu::stats().at("background_flushes") - flushes, 5);
  EXPECT_TRUE(torch::equal(xm.cpu(), x));
  torch_mgpu::set_async_ops(before);
  EXPECT_THROW(torch_mgpu::set_async_ops(-1), c10::Error);
}
