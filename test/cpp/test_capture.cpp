// The mgpu device from plain C++ (LibTorch, no Python, no TorchScript).
#include "capture/borrowed_args.h"
#include "ir/generators.h"

#include <ATen/CPUGeneratorImpl.h>
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

// Ops whose Meta kernels PyTorch registers from Python have none in a C++
// program: their geometry comes from one CPU run over zero-filled twins, and
// they are recorded like any other op (no eager fallback, no sync).
TEST(Cpp, OpsWithoutCppMetaKernelsAreRecorded) {
  torch::manual_seed(2);
  auto a = torch::randn({2, 3, 8, 8});
  auto w = torch::randn({4, 3, 3, 3});
  auto idx = torch::tensor({0, 1, 1});
  auto dev = torch_mgpu::device();
  auto am = a.to(dev), wm = w.to(dev), im = idx.to(dev);
  auto base = torch::tanh(am);  // pending: an eager fallback would force it to run
  const auto before = torch_mgpu::stats();
  std::vector<torch::Tensor> got = {
      torch::relu(base), torch::where(base > 0, base, base * 2), torch::conv2d(base, wm),
      torch::layer_norm(base, {8}), base.index_select(0, im),
      torch::batch_norm(base, {}, {}, {}, {}, true, 0.1, 1e-5, false), torch::abs(base)};
  const auto after = torch_mgpu::stats();
  EXPECT_EQ(after.at("eager_fallbacks"), before.at("eager_fallbacks"));
  EXPECT_EQ(after.at("syncs"), before.at("syncs"));
  EXPECT_GE(torch_mgpu::pending_ops(), static_cast<int64_t>(got.size()));
  auto b = torch::tanh(a);
  std::vector<torch::Tensor> want = {
      torch::relu(b), torch::where(b > 0, b, b * 2), torch::conv2d(b, w), torch::layer_norm(b, {8}),
      b.index_select(0, idx), torch::batch_norm(b, {}, {}, {}, {}, true, 0.1, 1e-5, false), torch::abs(b)};
  for (size_t k = 0; k < got.size(); ++k) {
    auto g = got[k].cpu();
    ASSERT_EQ(g.sizes(), want[k].sizes()) << k;
    EXPECT_TRUE(torch::allclose(g, want[k], 1e-5, 1e-6)) << k;
  }
}

TEST(Cpp, ShapeRunOfARandomOpLeavesTheGlobalGeneratorAlone) {
  torch::manual_seed(5);
  auto expected = torch::rand({4});
  torch::manual_seed(5);
  auto xm = torch::ones({50, 7}).to(torch_mgpu::device());
  auto d = torch::dropout(xm, 0.5, /*train=*/true);
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected));
  auto out = d.cpu();
  EXPECT_TRUE(((out == 0) | (out == 2)).all().item<bool>());
  EXPECT_GT((out == 0).sum().item<int64_t>(), 0);
}

// An op that draws from the default generator with no Generator argument
// runs seeded through its overload that takes one, with a generator of its
// own: the numbers of a generator seeded so, the default one not touched
// (another thread may be drawing from it).
TEST(Capture, SeededOpsWithoutAGeneratorDrawFromAGeneratorOfTheirOwn) {
  namespace ir = torch_mgpu::ir;
  auto op = [](const char* name, const char* overload) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  };
  for (const auto& [name, overload] : {std::pair{"aten::rand", ""}, {"aten::rand", "out"}, {"aten::randint", "low"},
                                       {"aten::randint", "low_out"}, {"aten::randperm", "out"},
                                       {"aten::randint_like", "low_dtype"}})
    EXPECT_TRUE(ir::has_generator_overload(op(name, overload))) << name << "." << overload;
  EXPECT_FALSE(ir::has_generator_overload(op("aten::native_dropout", "")));
  EXPECT_FALSE(ir::has_generator_overload(op("aten::rand", "generator")));

  torch::manual_seed(3);
  const at::Tensor state = at::detail::getDefaultCPUGenerator().get_state();
  auto own = [] { return at::make_generator<at::CPUGeneratorImpl>(42); };
  torch::jit::Stack s{c10::IValue(std::vector<int64_t>{6}), c10::IValue(), c10::IValue(), c10::IValue(),
                      c10::IValue()};
  ir::call_with_own_generator(op("aten::rand", ""), s, c10::Device(c10::kCPU), 42);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_TRUE(torch::equal(s[0].toTensor(), at::rand({6}, own())));
  // An out= overload: the generator goes before the out= argument.
  at::Tensor out = at::empty({5}, at::kLong), want = at::empty({5}, at::kLong);
  s = {c10::IValue(int64_t{2}), c10::IValue(int64_t{9}), c10::IValue(std::vector<int64_t>{5}), c10::IValue(out)};
  ir::call_with_own_generator(op("aten::randint", "low_out"), s, c10::Device(c10::kCPU), 42);
  at::randint_out(want, 2, 9, {5}, own());
  EXPECT_TRUE(torch::equal(out, want));
  EXPECT_TRUE(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), state));
}

// A borrowed argument holds no reference; own() gives it one; release()
// (or the destructor) empties the slot without touching the count.
TEST(Capture, BorrowedArgsTakeNoReferences) {
  auto t = torch::randn({3});
  ASSERT_EQ(t.use_count(), 1u);
  {
    torch::jit::Stack stack;
    torch_mgpu::capture::BorrowedArgs borrowed(&stack);
    borrowed.push(t);
    borrowed.push(int64_t{7});
    borrowed.push(at::Scalar(2.5));
    ASSERT_EQ(stack.size(), 3u);
    EXPECT_EQ(t.use_count(), 1u);
    EXPECT_TRUE(stack[0].toTensor().is_same(t));
    EXPECT_EQ(stack[1].toInt(), 7);
    at::Tensor copy = stack[0].toTensor();  // a copy is an ordinary reference
    EXPECT_EQ(t.use_count(), 2u);
    copy.reset();
    borrowed.release();
    EXPECT_TRUE(stack[0].isNone());
    EXPECT_EQ(t.use_count(), 1u);
  }
  EXPECT_EQ(t.use_count(), 1u);
  {
    torch::jit::Stack stack;
    torch_mgpu::capture::BorrowedArgs borrowed(&stack);
    borrowed.push(t);
    borrowed.own();
    EXPECT_EQ(t.use_count(), 2u);
    at::Tensor moved = std::move(stack[0]).toTensor();  // owned now: may be consumed
    stack.clear();
    EXPECT_EQ(t.use_count(), 2u);
  }
  EXPECT_EQ(t.use_count(), 1u);
  {  // the destructor releases what is still borrowed (an exception's way out)
    torch::jit::Stack stack;
    torch_mgpu::capture::BorrowedArgs borrowed(&stack);
    borrowed.push(t);
    borrowed.push(t);
  }
  EXPECT_EQ(t.use_count(), 1u);
  auto other = torch::randn({2});
  {  // a slot written over is refused by release(), and the destructor
     // (which must not throw) leaves it to the stack
    torch::jit::Stack stack;
    torch_mgpu::capture::BorrowedArgs borrowed(&stack);
    borrowed.push(t);
    at::Tensor out = std::move(stack[0]).toTensor();
    c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(out);
    stack[0] = other;
    EXPECT_EQ(other.use_count(), 2u);
    EXPECT_THROW(borrowed.release(), c10::Error);
  }
  EXPECT_EQ(t.use_count(), 1u);
  EXPECT_EQ(other.use_count(), 1u);
}

// Calls on mgpu tensors (recorded, raising, run eagerly, in place, called
// boxed) leave their arguments' reference counts as they found them, and
// compute what eager computes.
TEST(Capture, CallsKeepTheirArgumentsReferenceCounts) {
  torch::manual_seed(3);
  auto a = torch::randn({4, 5}), b = torch::randn({4, 5});
  auto am = a.to(torch_mgpu::device()), bm = b.to(torch_mgpu::device());
  ASSERT_EQ(am.use_count(), 1u);
  ASSERT_EQ(bm.use_count(), 1u);
  auto sum = am + bm;                                // recorded
  auto scaled = torch::relu(am * 2.0).sub(bm, 0.5);  // recorded, Scalar arguments
  EXPECT_THROW(torch::mm(am, bm), c10::Error);       // refused at the call
  EXPECT_THROW(am + torch::randn({3}).to(torch_mgpu::device()), c10::Error);  // refused by Meta
  auto nz = torch::nonzero(am > 0);                  // runs eagerly
  at::Tensor& same = am.add_(bm);                    // in place: returns its argument
  EXPECT_TRUE(same.is_same(am));
  static auto boxed = c10::Dispatcher::singleton().findSchemaOrThrow("aten::mul", "Tensor");
  torch::jit::Stack stack{am, bm};
  boxed.callBoxed(&stack);                           // the unboxed kernel, called boxed
  auto product = stack.at(0).toTensor();
  stack.clear();
  EXPECT_EQ(am.use_count(), 1u);
  EXPECT_EQ(bm.use_count(), 1u);
  EXPECT_TRUE(torch::allclose(sum.cpu(), a + b));
  EXPECT_TRUE(torch::allclose(scaled.cpu(), torch::relu(a * 2.0).sub(b, 0.5)));
  EXPECT_TRUE(torch::equal(nz.cpu(), torch::nonzero(a > 0)));
  a.add_(b);
  EXPECT_TRUE(torch::allclose(am.cpu(), a));
  EXPECT_TRUE(torch::allclose(product.cpu(), a * b));
  EXPECT_EQ(am.use_count(), 1u);
  EXPECT_EQ(bm.use_count(), 1u);
}
