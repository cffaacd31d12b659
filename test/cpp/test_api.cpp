// The C++ API (csrc/include/torch_mgpu/mgpu.h) from a LibTorch program: the
// Python verbs as free functions, errors as c10::Error with clear messages.
#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include "engine/engine.h"
#include "plan/cost_model.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace {

// Restores the lanes and policy a test changed.
struct KeepLanes {
  std::vector<std::string> lanes = torch_mgpu::lanes();
  std::string policy = torch_mgpu::policy();
  ~KeepLanes() {
    std::set<std::string> devices;
    for (const auto& l : lanes) devices.insert(l.substr(0, l.find('/')));
    torch_mgpu::configure(std::vector<std::string>(devices.size(), "cpu"),
                          static_cast<int>(lanes.size() / devices.size()), policy);
  }
};

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

TEST(Api, InitRegistersTheDeviceNameAndIsIdempotent) {
  torch_mgpu::init();
  torch_mgpu::init();
  torch::Device d("mgpu");
  EXPECT_TRUE(d.is_privateuseone());
  EXPECT_EQ(d.type(), torch_mgpu::device().type());
  EXPECT_EQ(torch::Device("mgpu:0"), torch_mgpu::device(0));
  EXPECT_EQ(c10::get_privateuse1_backend(), "mgpu");
}

TEST(Api, ConfigureLanesPolicyAndVirtualDevices) {
  KeepLanes keep;
  torch_mgpu::configure({"cpu", "cpu"}, 2, "heft");
  EXPECT_EQ(torch_mgpu::lanes(), (std::vector<std::string>{"cpu:0/lane0", "cpu:0/lane1", "cpu:1/lane0", "cpu:1/lane1"}));
  EXPECT_EQ(torch_mgpu::policy(), "heft");
  torch::manual_seed(3);
  std::vector<torch::Tensor> xs, xm;
  for (int k = 0; k < 4; ++k) {
    xs.push_back(torch::randn({96, 96}));
    xm.push_back(xs.back().to(torch_mgpu::device()));
  }
  auto sum = [](const std::vector<torch::Tensor>& v) {
    auto f = torch::tanh(v[0].matmul(v[0]));
    for (size_t k = 1; k < v.size(); ++k) f = f + torch::tanh(v[k].matmul(v[k]));
    return f;
  };
  auto got = sum(xm).cpu();
  EXPECT_TRUE(torch::allclose(got, sum(xs), 1e-5, 1e-5));
  auto plan = torch_mgpu::last_plan();
  ASSERT_TRUE(plan.valid);
  std::set<std::string> used;
  for (const auto& e : plan.timeline) used.insert(e.lane);
  EXPECT_GE(used.size(), 2u) << plan.text;
  EXPECT_GT(plan.measured_makespan, 0);
  EXPECT_NE(plan.dot.find("digraph"), std::string::npos);
}

TEST(Api, BadInputThrowsClearErrors) {
  KeepLanes keep;
  EXPECT_NE(message_of([] { torch_mgpu::configure({"tpu:0"}); }).find("tpu:0"), std::string::npos);
  EXPECT_NE(message_of([] { torch_mgpu::configure({}, -2); }).find("lanes_per_device must be >= 1"), std::string::npos);
  EXPECT_NE(message_of([] { torch_mgpu::configure({}, 0, "fastest"); }).find("unknown policy 'fastest'"),
            std::string::npos);
  EXPECT_NE(message_of([] { torch_mgpu::simulate(2, 0); }).find("lanes_per_device must be >= 1"), std::string::npos);
  EXPECT_NE(message_of([] { torch_mgpu::set_max_pending_ops(0); }).find("must be positive"), std::string::npos);
  EXPECT_NE(message_of([] { torch::zeros({2}, torch::Device("mgpu:3")); }).find("out of range"), std::string::npos);
  EXPECT_EQ(torch_mgpu::policy(), keep.policy);  // refused calls changed nothing
  EXPECT_EQ(torch_mgpu::lanes(), keep.lanes);
}

TEST(Api, ErrorsAtTheSyncKeepOtherResults) {
  auto bad = torch::randn({4, 4});
  bad = -bad.matmul(bad.t()) - torch::eye(4);  // negative definite
  auto good = torch::randn({4, 4});
  auto bm = bad.to(torch_mgpu::device());
  auto gm = good.to(torch_mgpu::device());
  auto l = torch::linalg_cholesky(bm);  // recorded: the error comes at the sync
  auto t = torch::tanh(gm);
  const std::string msg = message_of([] { torch_mgpu::synchronize(); });
  EXPECT_NE(msg.find("not positive-definite"), std::string::npos) << msg;
  EXPECT_TRUE(torch::equal(t.cpu(), torch::tanh(good)));
  EXPECT_THROW(l.cpu(), c10::Error);
}

TEST(Api, ErrorsNameTheOpByItsNumberWithoutPython) {
  auto x = torch::randn({3}).to(torch_mgpu::device());
  auto idx = torch::tensor({0, 7}).to(torch_mgpu::device());
  auto y = torch::index_select(x, 0, idx);  // out of range: known only from the data
  EXPECT_THROW(torch_mgpu::synchronize(), c10::IndexError);
  torch_mgpu::synchronize();  // raised once
  const std::string msg = message_of([&] { y.cpu(); });
  EXPECT_NE(msg.find("lost"), std::string::npos) << msg;
  EXPECT_NE(msg.find("aten::index_select (op #"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("called at"), std::string::npos) << msg;  // no caller without Python
  EXPECT_TRUE(torch::equal((x + 1).cpu(), x.cpu() + 1));
}

TEST(Api, OutputLayoutsOfKernelsThatKeepTheirInputsStrides) {
  auto x = torch::randn({2, 3});
  auto xm = x.to(torch_mgpu::device());
  EXPECT_TRUE(torch::equal(xm.t().abs().cpu(), x.t().abs()));  // abs.out into empty(0)
  EXPECT_TRUE(torch::equal(torch::logical_and(xm.t(), xm.t() > 0).cpu(), torch::logical_and(x.t(), x.t() > 0)));
}

TEST(Api, AutogradFromCpp) {
  torch::manual_seed(4);
  auto w = torch::randn({8, 8});
  auto x = torch::randn({8, 8});
  auto wm = w.to(torch_mgpu::device()).set_requires_grad(true);
  auto xm = x.to(torch_mgpu::device());
  auto loss = torch::tanh(xm.matmul(wm)).pow(2).sum();
  loss.backward();
  auto wc = w.clone().set_requires_grad(true);
  torch::tanh(x.matmul(wc)).pow(2).sum().backward();
  EXPECT_TRUE(wm.grad().device().is_privateuseone());
  EXPECT_TRUE(torch::allclose(wm.grad().cpu(), wc.grad(), 1e-5, 1e-5));
  EXPECT_NEAR(loss.item<float>(), torch::tanh(x.matmul(w)).pow(2).sum().item<float>(), 1e-3);
}

TEST(Api, SimulateStatsAndLimits) {
  torch_mgpu::synchronize();
  // That 4 lanes beat 1 is the plan's shape: it follows a pinned model (the
  // figures of test/conftest.py's REFERENCE_MODEL), not one calibrated on a
  // busy machine, where a lane's wake-up can cost more than a product.
  torch_mgpu::plan::CostModel reference;
  reference.calibrated = true;
  reference.gemm_flops_per_s = reference.small_gemm_flops_per_s = 1.0e11;
  reference.elem_per_s = 1.0e10;
  reference.transcendental_per_s = 4.0e8;
  reference.bytes_per_s = 1.25e11;
  reference.op_overhead_s = 1.2e-6;
  reference.lane_sync_s = 1.4e-5;
  reference.launch_s = 5.5e-5;
  reference.parallel_min_flops = 8.19e6;
  reference.parallel_efficiency = 0.9;
  torch_mgpu::engine::pin_cost_model(reference);
  const int64_t async = torch_mgpu::async_ops();
  torch_mgpu::set_async_ops(0);
  auto x = torch::randn({128, 128}).to(torch_mgpu::device());  // branches that lanes clearly speed up
  std::vector<torch::Tensor> ys;
  for (int k = 0; k < 8; ++k) ys.push_back(torch::tanh(x.matmul(x) * (k + 1)));
  EXPECT_GE(torch_mgpu::pending_ops(), 16);
  auto s1 = torch_mgpu::simulate(1, 1);
  auto s4 = torch_mgpu::simulate(4, 1);
  EXPECT_GE(s1.makespan, s1.lower_bound * 0.999);
  EXPECT_LT(s4.makespan, s1.makespan);
  EXPECT_FALSE(s4.plan.timeline.empty());
  EXPECT_GE(torch_mgpu::pending_ops(), 16) << "simulate runs nothing";
  const auto before = torch_mgpu::stats();
  torch_mgpu::synchronize();
  EXPECT_EQ(torch_mgpu::pending_ops(), 0);
  EXPECT_GT(torch_mgpu::stats().at("ops_executed"), before.at("ops_executed"));
  const int64_t limit = torch_mgpu::max_pending_ops();
  torch_mgpu::set_max_pending_ops(5);
  auto z = x;
  for (int k = 0; k < 12; ++k) z = z + 1;
  EXPECT_LE(torch_mgpu::pending_ops(), 5);
  torch_mgpu::set_max_pending_ops(limit);
  torch_mgpu::set_async_ops(async);
  torch_mgpu::empty_cache();
  EXPECT_EQ(torch_mgpu::stats().at("host_cache_bytes"), 0);
  auto want = x.cpu();
  for (int k = 0; k < 12; ++k) want = want + 1;
  EXPECT_TRUE(torch::equal(z.cpu(), want));
  torch_mgpu::engine::pin_cost_model(std::nullopt);
}

// A C++ program that changes a process-wide setting with ops in flight
// waits for the flight first: the flight's kernels read the setting while
// they run (sin of an int32 tensor computes in the default dtype).
TEST(Api, WaitForFlightBeforeChangingASetting) {
  torch_mgpu::synchronize();
  const int64_t async = torch_mgpu::async_ops();
  torch_mgpu::set_async_ops(3);
  auto a = torch::randn({600, 600});
  auto i = torch::tensor({1000000007, 123456789, 987654321}, torch::kInt32);
  auto want = i.sin();
  auto am = a.to(torch_mgpu::device());
  auto im = i.to(torch_mgpu::device());
  torch_mgpu::synchronize();
  auto m = am.matmul(am);
  m = m.matmul(am);
  auto s = im.sin();  // the third op: a flight starts, the products first
  torch_mgpu::wait_for_flight();
  const auto saved = c10::get_default_dtype();
  c10::set_default_dtype(c10::scalarTypeToTypeMeta(torch::kDouble));
  auto got = s.cpu();
  c10::set_default_dtype(saved);
  torch_mgpu::set_async_ops(async);
  EXPECT_EQ(got.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(got, want)) << got << want;
  torch_mgpu::wait_for_flight();  // nothing in flight: returns
}

} // namespace

namespace {

// nn::Module::to moves each parameter in place (Variable::set_data): the
// module's parameters, and an optimizer made before the move, see the moved
// tensors, as with CUDA.
TEST(Api, ModuleToKeepsParameterObjects) {
  torch::manual_seed(6);
  torch::nn::Linear lin(4, 3);
  auto before = lin->weight.unsafeGetTensorImpl();
  torch::optim::SGD opt(lin->parameters(), 0.1);
  lin->to(torch_mgpu::device());
  EXPECT_EQ(lin->weight.unsafeGetTensorImpl(), before);
  EXPECT_TRUE(lin->weight.device().is_privateuseone());
  auto w0 = lin->weight.cpu();
  auto x = torch::randn({5, 4});
  auto loss = lin->forward(x.to(torch_mgpu::device())).pow(2).sum();
  opt.zero_grad();
  loss.backward();
  opt.step();  // steps the moved weight
  EXPECT_FALSE(torch::equal(lin->weight.cpu(), w0));
  lin->to(torch::kCPU);
  EXPECT_EQ(lin->weight.unsafeGetTensorImpl(), before);
  EXPECT_TRUE(lin->weight.device().is_cpu());
}

} // namespace
