// Threads against the mgpu device: several threads capture, sync and call
// every API function at once, for a bounded time, and every result must
// equal eager CPU. Built with ThreadSanitizer by `bash scripts/dev.sh tsan`,
// which is what finds the races; a plain build checks the results.
// TORCH_MGPU_STRESS_SECONDS sets how long each test runs (default 3).
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <torch_mgpu/mgpu.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kThreads = 4;
constexpr int64_t kMinIterations = 3;  // even when one iteration outlasts the deadline (TSAN)

double stress_seconds() {
  const char* e = std::getenv("TORCH_MGPU_STRESS_SECONDS");
  const double s = e ? std::atof(e) : 3.0;
  return s > 0 ? s : 3.0;
}

// What went wrong on any thread; checked on the test's thread.
struct Failures {
  std::mutex m;
  std::vector<std::string> messages;
  void add(std::string s) {
    std::lock_guard<std::mutex> lock(m);
    messages.push_back(std::move(s));
  }
  std::string joined() {
    std::lock_guard<std::mutex> lock(m);
    std::string out;
    for (size_t k = 0; k < messages.size() && k < 20; ++k) out += messages[k] + "\n";
    if (messages.size() > 20) out += "... and " + std::to_string(messages.size() - 20) + " more\n";
    return out;
  }
  bool empty() {
    std::lock_guard<std::mutex> lock(m);
    return messages.empty();
  }
};

// Runs body(t) on `n` threads; an exception on a thread is a failure, never
// a crash.
void run_threads(int n, Failures& failures, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      try {
        body(t);
      } catch (const std::exception& e) {
        failures.add("thread " + std::to_string(t) + " threw: " + e.what());
      } catch (...) {
        failures.add("thread " + std::to_string(t) + " threw a non-std exception");
      }
    });
  }
  for (auto& th : threads) th.join();
}

// Every call gets a shape no call made before (in this process): the first
// dimension cycles, the second grows, so signatures are new and the meta
// cache misses.
std::atomic<int64_t> next_shape{0};
std::pair<int64_t, int64_t> new_shape() {
  const int64_t k = next_shape.fetch_add(1);
  return {2 + k % 29, 3 + k / 29};
}
int64_t bounded(int64_t n, int64_t lo, int64_t hi) { return lo + n % (hi - lo + 1); }

// The API settings a test changes, put back when it ends.
struct Restore {
  int64_t async = torch_mgpu::async_ops();
  std::string policy = torch_mgpu::policy();
  ~Restore() {
    try {
      torch_mgpu::synchronize();
      torch_mgpu::set_max_pending_ops(100000);
      torch_mgpu::set_async_ops(async);
      torch_mgpu::configure({"cpu"}, 0, policy);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "restoring the settings: " << e.what();
    }
  }
};

struct Worker {
  int id;
  std::mt19937 rng;
  at::Generator gen;
  Failures& failures;
  int64_t iterations = 0;
  int64_t checks = 0;

  Worker(int id, uint32_t seed, Failures& f)
      : id(id), rng(seed), gen(at::make_generator<at::CPUGeneratorImpl>(seed)), failures(f) {}

  int pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); }
  // Random, never zero: normal values pushed away from 0.
  at::Tensor input(at::IntArrayRef size) {
    auto x = torch::randn(size, gen);
    return x + x.sign() * 0.05 + (x == 0).to(torch::kFloat);
  }
  void check(const char* what, const at::Tensor& mgpu, const at::Tensor& eager) {
    ++checks;
    if (!mgpu.device().is_privateuseone()) {
      failures.add(std::string(what) + ": result not on mgpu");
      return;
    }
    auto got = mgpu.to(torch::kCPU);
    std::ostringstream why;
    if (got.sizes() != eager.sizes()) {
      why << "sizes " << got.sizes() << " vs eager " << eager.sizes();
    } else if (!torch::allclose(got, eager, 1e-4, 1e-5)) {
      why << "max |diff| " << (got - eager).abs().max().item<float>();
    } else {
      return;
    }
    failures.add("thread " + std::to_string(id) + " " + what + ": " + why.str());
  }
  void expect(bool ok, const std::string& what) {
    ++checks;
    if (!ok) failures.add("thread " + std::to_string(id) + ": " + what);
  }

  // matmul, tanh, relu, add, in-place add_ on a view, transposes, slices.
  void pipeline() {
    auto [r, c] = new_shape();
    auto a = input({r, c}), b = input({c, r}), v = input({c});
    const auto dev = torch_mgpu::device();
    auto am = a.to(dev), bm = b.to(dev), vm = v.to(dev);
    auto f = [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& v) {
      auto p = torch::mm(a, b);                       // r x r
      auto w = torch::tanh(p) + torch::relu(p - 0.1);
      w.add_(1.0);
      w.slice(0, 0, w.size(0) / 2 + 1).mul_(2);       // in place through a view
      w.t().slice(0, 1).add_(a.select(1, 0));         // through a transposed view
      auto u = (a + v).transpose(0, 1);               // c x r, broadcast then a view
      auto out = torch::matmul(u, w);                 // c x r
      return std::make_pair(w, out.narrow(0, 0, std::max<int64_t>(1, out.size(0) - 1)).reshape({-1}));
    };
    auto [wm, om] = f(am, bm, vm);
    auto [we, oe] = f(a, b, v);
    check("pipeline/w", wm, we);
    check("pipeline/out", om, oe);
  }

  // A long elementwise chain: background flights (async_ops small) and
  // automatic syncs (max_pending_ops small) cut it.
  void chain() {
    auto [r, c] = new_shape();
    auto x = input({r * c});
    auto xm = x.to(torch_mgpu::device());
    const int n = 10 + pick(70);
    for (int k = 0; k < n; ++k) {
      if (k % 7 == 3) {
        x = x.relu() + x * 0.5;
        xm = xm.relu() + xm * 0.5;
      } else {
        x = (x * 1.01).add_(0.01);
        xm = (xm * 1.01).add_(0.01);
      }
    }
    check("chain", xm, x);
  }

  // Reads tensors every thread shares (made before the threads start, one of
  // them still pending then): read-only here.
  void shared(const at::Tensor& s, const at::Tensor& sm, const at::Tensor& lazy, const at::Tensor& lazym) {
    auto [r, c] = new_shape();
    const int64_t n = s.size(0);
    const int64_t k = bounded(c, 1, n);
    auto a = input({r, n});
    auto am = a.to(torch_mgpu::device());
    auto f = [&](const at::Tensor& a, const at::Tensor& s, const at::Tensor& lazy) {
      return torch::relu(torch::mm(a, lazy)).slice(1, 0, k) + s.slice(1, n - k).sum(0);
    };
    check("shared", f(am, sm, lazym), f(a, s, lazy));
  }

  void api_call() {
    switch (pick(10)) {
      case 9:
        torch_mgpu::init();
        break;
      case 0:
        torch_mgpu::synchronize();
        expect(torch_mgpu::pending_ops() >= 0, "pending_ops < 0");
        break;
      case 1: {
        auto st = torch_mgpu::stats();
        expect(st.count("ops_captured") && st.at("ops_executed") >= 0 && st.at("host_cache_bytes") >= 0,
               "stats() incomplete");
        break;
      }
      case 2:
        torch_mgpu::empty_cache();
        break;
      case 3: {
        const int64_t values[] = {16, 64, 1000, 100000};
        torch_mgpu::set_max_pending_ops(values[pick(4)]);
        expect(torch_mgpu::max_pending_ops() > 0, "max_pending_ops <= 0");
        break;
      }
      case 4: {
        const int64_t values[] = {0, 8, 64, 256};
        torch_mgpu::set_async_ops(values[pick(4)]);
        expect(torch_mgpu::async_ops() >= 0, "async_ops < 0");
        break;
      }
      case 5: {
        auto l = torch_mgpu::lanes();
        auto p = torch_mgpu::policy();
        expect(!l.empty(), "no lanes");
        expect(p == "auto" || p == "heft" || p == "serial", "policy '" + p + "'");
        break;
      }
      case 6: {
        auto p = torch_mgpu::last_plan();
        if (p.valid) expect(!p.lanes.empty() && !p.text.empty() && p.lanes_used >= 1, "last_plan() inconsistent");
        break;
      }
      case 7: {
        auto s = torch_mgpu::simulate(2, 2);
        expect(std::isfinite(s.makespan) && s.makespan >= 0 && s.total_work >= 0, "simulate(2, 2)");
        break;
      }
      case 8: {
        if (pick(3) != 0) break;  // configure syncs everything: rarer
        switch (pick(5)) {
          case 0: torch_mgpu::configure({"cpu"}, 2); break;
          case 1: torch_mgpu::configure({"cpu", "cpu"}, 1); break;
          case 2: torch_mgpu::configure({}, 0, "auto"); break;
          case 3: torch_mgpu::configure({}, 0, "heft"); break;
          default: torch_mgpu::configure({}, 0, "serial"); break;
        }
        break;
      }
    }
  }
};

TEST(Stress, ThreadsCaptureSyncAndCallEveryApi) {
  Restore restore;
  Failures failures;
  const auto dev = torch_mgpu::device();
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(1234);
  const auto s = torch::randn({24, 24}, g) + 0.1;
  const auto sm = s.to(dev);
  torch_mgpu::synchronize();
  const auto lazy = torch::tanh(torch::mm(s, s)).add(0.5);
  const auto lazym = torch::tanh(torch::mm(sm, sm)).add(0.5);  // pending when the threads start
  ASSERT_GT(torch_mgpu::pending_ops(), 0);

  const auto before = torch_mgpu::stats();
  const auto deadline = Clock::now() + std::chrono::duration<double>(stress_seconds());
  std::vector<int64_t> iterations(kThreads, 0), checks(kThreads, 0);
  run_threads(kThreads, failures, [&](int t) {
    Worker w(t, 1000u + static_cast<uint32_t>(t), failures);
    while (Clock::now() < deadline || w.iterations < kMinIterations) {
      const int action = w.pick(10);
      if (action < 3) w.pipeline();
      else if (action < 5) w.chain();
      else if (action < 7) w.shared(s, sm, lazy, lazym);
      else w.api_call();
      ++w.iterations;
      iterations[t] = w.iterations;
      checks[t] = w.checks;
    }
  });
  EXPECT_TRUE(failures.empty()) << failures.joined();
  const auto after = torch_mgpu::stats();
  std::cout << "[ stress   ] iterations per thread:";
  for (int t = 0; t < kThreads; ++t) std::cout << " " << iterations[t];
  for (const char* c : {"ops_captured", "syncs", "background_flushes", "meta_cache_misses", "plans_built"})
    std::cout << ", " << c << " +" << after.at(c) - before.at(c);
  std::cout << std::endl;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_GE(iterations[t], kMinIterations) << "thread " << t;
    EXPECT_GT(checks[t], 0) << "thread " << t;
  }
  // The shared tensors are intact after all of it.
  EXPECT_TRUE(torch::equal(sm.to(torch::kCPU), s));
  EXPECT_TRUE(torch::allclose(lazym.to(torch::kCPU), lazy, 1e-4, 1e-5));
}

// A monitoring thread reads the lanes, counters and last plan while another
// thread captures, syncs and reconfigures.
TEST(Stress, MonitorThreadReadsWhileAnotherCaptures) {
  Restore restore;
  Failures failures;
  const auto deadline = Clock::now() + std::chrono::duration<double>(stress_seconds() / 2);
  std::atomic<bool> capturing{true};
  int64_t captured = 0, polls = 0;
  run_threads(2, failures, [&](int t) {
    if (t == 0) {
      Worker w(t, 77u, failures);
      struct Done {
        std::atomic<bool>& flag;
        ~Done() { flag = false; }
      } done{capturing};
      while (Clock::now() < deadline || w.iterations < kMinIterations) {
        if (w.pick(2)) w.pipeline();
        else w.chain();
        if (w.pick(4) == 0) torch_mgpu::synchronize();
        if (w.pick(8) == 0) torch_mgpu::set_async_ops(w.pick(2) ? 8 : 0);
        if (w.pick(16) == 0) {
          if (w.pick(2)) torch_mgpu::configure({"cpu"}, 1 + w.pick(2), w.pick(2) ? "heft" : "auto");
          else torch_mgpu::configure({"cpu", "cpu"}, 1, "serial");
        }
        captured = ++w.iterations;
      }
      return;
    }
    Worker m(t, 78u, failures);
    std::map<std::string, int64_t> seen;
    while (capturing || m.iterations < kMinIterations) {
      auto l = torch_mgpu::lanes();
      m.expect(!l.empty(), "no lanes");
      auto st = torch_mgpu::stats();
      for (const char* counter : {"ops_captured", "ops_executed", "syncs", "plans_built", "meta_cache_misses"}) {
        m.expect(st.at(counter) >= seen[counter], std::string("stats() ") + counter + " went down");
        seen[counter] = st.at(counter);
      }
      auto p = torch_mgpu::last_plan();
      if (p.valid) {
        for (const auto& e : p.timeline) {
          if (std::find(p.lanes.begin(), p.lanes.end(), e.lane) == p.lanes.end()) {
            m.expect(false, "last_plan() node on lane '" + e.lane + "' not in its lanes");
            break;
          }
        }
        m.expect(!p.text.empty() && !p.dot.empty(), "last_plan() text");
      }
      torch_mgpu::init();
      auto pol = torch_mgpu::policy();
      m.expect(pol == "auto" || pol == "heft" || pol == "serial", "policy '" + pol + "'");
      m.expect(torch_mgpu::pending_ops() >= 0 && torch_mgpu::async_ops() >= 0 && torch_mgpu::max_pending_ops() > 0,
               "counters");
      polls = ++m.iterations;
      std::this_thread::yield();
    }
  });
  EXPECT_TRUE(failures.empty()) << failures.joined();
  std::cout << "[ stress   ] capture iterations " << captured << ", monitor polls " << polls << std::endl;
  EXPECT_GE(captured, kMinIterations);
  EXPECT_GE(polls, kMinIterations);
}

} // namespace
