#include "runtime/executor.h"
#include "stats.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>

#include "runtime/lanes.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <tuple>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace torch_mgpu::runtime {

at::Tensor cpu_view(const c10::Storage& storage, const ir::TensorGeometry& geom) {
  return ir::make_view(storage, c10::DispatchKey::CPU, geom);
}

c10::Storage allocate(size_t nbytes) {
  auto* alloc = c10::GetAllocator(c10::DeviceType::CPU);
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, alloc->allocate(nbytes), alloc, true));
}

namespace {

c10::Storage copy_bytes(const c10::Storage& src) {
  c10::Storage dst = allocate(src.nbytes());
  if (src.nbytes()) std::memcpy(dst.mutable_data(), src.data(), src.nbytes());
  return dst;
}

// Ops that draw from the global CPU generator with no Generator argument
// (native_dropout) run with the node's own seed, one at a time.
std::mutex& global_generator_mutex() {
  static std::mutex m;
  return m;
}

bool same_geometry(const at::Tensor& t, const ir::TensorGeometry& g) {
  return t.scalar_type() == g.dtype && t.sizes() == c10::IntArrayRef(g.sizes) &&
      t.strides() == c10::IntArrayRef(g.strides) && t.storage_offset() == g.offset && t.is_conj() == g.conj &&
      t.is_neg() == g.neg;
}

c10::IValue tensor_ivalue(const std::optional<ir::TensorRef>& r, const std::vector<c10::Storage>& s) {
  if (!r) return c10::IValue();
  return cpu_view(s[r->operand], r->geom);
}

} // namespace

std::vector<c10::Storage> run_node(const ir::Node& n, std::vector<c10::Storage> operands,
                                   const std::vector<bool>& reuse) {
  // Each operand a distinct storage; writes go to a private copy unless the
  // plan proved this node the value's only reader.
  for (const auto& o : n.outputs)
    if (o.mutated_operand >= 0 && !reuse[o.mutated_operand])
      operands[o.mutated_operand] = copy_bytes(operands[o.mutated_operand]);

  torch::jit::Stack stack;
  stack.reserve(n.args.size());
  for (const auto& a : n.args) {
    switch (a.kind) {
      case ir::Arg::Kind::Constant:
        stack.push_back(a.constant);
        break;
      case ir::Arg::Kind::Tensor:
        stack.push_back(tensor_ivalue(a.tensors[0], operands));
        break;
      case ir::Arg::Kind::TensorList: {
        c10::List<at::Tensor> l;
        for (const auto& r : a.tensors) l.push_back(tensor_ivalue(r, operands).toTensor());
        stack.emplace_back(l);
        break;
      }
      case ir::Arg::Kind::OptionalTensorList: {
        c10::List<std::optional<at::Tensor>> l;
        for (const auto& r : a.tensors)
          l.push_back(r ? std::optional<at::Tensor>(cpu_view(operands[r->operand], r->geom)) : std::nullopt);
        stack.emplace_back(l);
        break;
      }
    }
  }
  {
    RECORD_FUNCTION("mgpu::" + n.name, std::vector<c10::IValue>());
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (n.seed) {
      // One seeded op at a time; the generator's own mutex is not held while
      // the op runs, since the op locks it to draw.
      std::lock_guard<std::mutex> lock(global_generator_mutex());
      auto gen = at::detail::getDefaultCPUGenerator();
      at::Generator saved;
      {
        std::lock_guard<std::mutex> glock(gen.mutex());
        saved = gen.clone();
        gen.set_current_seed(*n.seed);
      }
      auto restore = [&] {
        std::lock_guard<std::mutex> glock(gen.mutex());
        gen.set_state(saved.get_state());
      };
      try {
        n.op->callBoxed(&stack);
      } catch (...) {
        restore();
        throw;
      }
      restore();
    } else {
      n.op->callBoxed(&stack);
    }
  }
  // Flatten the returned tensors.
  std::vector<at::Tensor> returned;
  for (const auto& v : stack) {
    if (v.isTensor()) returned.push_back(v.toTensor());
    else if (v.isTensorList())
      for (const auto& t : v.toTensorList()) returned.push_back(t);
    else
      returned.emplace_back();
  }
  std::vector<c10::Storage> out;
  out.reserve(n.outputs.size());
  for (const auto& o : n.outputs) {
    if (o.mutated_operand >= 0) {
      out.push_back(operands[o.mutated_operand]);
      continue;
    }
    TORCH_INTERNAL_ASSERT(o.returned >= 0 && o.returned < static_cast<int>(returned.size()));
    const at::Tensor& r = returned[o.returned];
    bool aliases = false;
    for (const auto& s : operands)
      if (s.unsafeGetStorageImpl() == r.storage().unsafeGetStorageImpl()) aliases = true;
    // The recorded geometry (from Meta) is what the mgpu tensor claims; when
    // the CPU kernel chose another layout, or returned an input, copy.
    if (r.sizes() != c10::IntArrayRef(o.geom.sizes)) {
      // Meta and CPU kernels disagree on the shape of an auxiliary output
      // that one of them leaves empty (batch norm's saved statistics in eval
      // mode, embedding_bag's bookkeeping): the mgpu tensor keeps Meta's
      // shape, filled with zeros. Anything else is a real disagreement.
      int64_t want = c10::multiply_integers(o.geom.sizes);
      TORCH_CHECK(r.numel() == 0 || want == 0, "mgpu: ", n.name, " returned shape ", r.sizes(),
                  " where its Meta kernel promised ", c10::IntArrayRef(o.geom.sizes));
      c10::Storage fresh = allocate(o.nbytes);
      if (o.nbytes) std::memset(fresh.mutable_data(), 0, o.nbytes);
      out.push_back(fresh);
    } else if (aliases || !same_geometry(r, o.geom) || r.storage().nbytes() < o.nbytes) {
      c10::Storage fresh = allocate(o.nbytes);
      cpu_view(fresh, o.geom).copy_(r);
      out.push_back(fresh);
    } else {
      out.push_back(r.storage());
    }
  }
  counters().ops_executed++;
  return out;
}

namespace {

// Shared by the lanes of one execution. Guarded by `m`: statuses, values,
// reader counts and cross-device copies. Lanes wait on `cv` for inputs.
struct Run {
  const ir::Graph& g;
  const plan::Plan& p;
  ExecResult& res;
  std::unordered_map<const ir::Node*, int> index;
  std::vector<std::vector<int>> readers;
  std::vector<std::vector<bool>> is_root;
  std::map<std::tuple<int, int, int>, c10::Storage> copies;  // (node, output, device)
  std::mutex m;
  std::condition_variable cv;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  bool parallel = false;

  Run(const ir::Graph& graph, const plan::Plan& plan, ExecResult& r) : g(graph), p(plan), res(r) {
    for (size_t i = 0; i < g.size(); ++i) index[g.nodes[i].get()] = static_cast<int>(i);
    readers.resize(g.size());
    for (size_t i = 0; i < g.size(); ++i) readers[i].assign(g.nodes[i]->outputs.size(), 0);
    for (const auto& node : g.nodes)
      for (const auto& v : node->operands) {
        auto it = index.find(v.node.get());
        if (it != index.end()) readers[it->second][v.index]++;
      }
    is_root.resize(g.size());
    for (size_t i = 0; i < g.size(); ++i) is_root[i].assign(g.nodes[i]->outputs.size(), false);
    for (const auto& r2 : g.roots) {
      auto it = index.find(r2.node.get());
      if (it != index.end()) is_root[it->second][r2.index] = true;
    }
  }

  double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }

  void fail(int i, Status s, std::exception_ptr e, const std::string& msg) {
    res.status[i] = s;
    if (e && !res.first_error) {
      res.first_error = e;
      res.first_message = msg;
    }
  }

  // The bytes of operand value v for a node on `device`; a value made on
  // another device is copied over (a transfer), once per device.
  c10::Storage operand(const ir::Value& v, int device, std::unique_lock<std::mutex>& lock) {
    auto it = index.find(v.node.get());
    if (it == index.end()) {
      if (v.node->kind == ir::NodeKind::Data) return v.node->data;
      return allocate(v.node->outputs[0].nbytes);  // Empty: fresh bytes
    }
    int d = it->second;
    int from = p.lanes[p.lane_of[d]].device;
    c10::Storage src = res.values[d][v.index];
    if (from == device) return src;
    auto key = std::make_tuple(d, v.index, device);
    auto c = copies.find(key);
    if (c != copies.end()) return c->second;
    lock.unlock();
    c10::Storage moved = copy_bytes(src);
    counters().bytes_transferred += static_cast<int64_t>(moved.nbytes());
    lock.lock();
    return copies.emplace(key, moved).first->second;
  }

  void run_one(int lane, int i) {
    const ir::Node& node = *g.nodes[i];
    const int device = p.lanes[lane].device;
    std::unique_lock<std::mutex> lock(m);
    if (parallel) {
      cv.wait(lock, [&] {
        for (int d : g.deps[i])
          if (res.status[d] == Status::NotRun) return false;
        return true;
      });
    }
    std::vector<c10::Storage> operands;
    operands.reserve(node.operands.size());
    for (const auto& v : node.operands) {
      auto it = index.find(v.node.get());
      bool missing = it != index.end() ? res.status[it->second] != Status::Ok
                                       : v.node->kind == ir::NodeKind::Error;
      if (missing) {
        std::exception_ptr e;
        std::string msg;
        if (it == index.end()) {
          msg = v.node->error;
          try {
            TORCH_CHECK(false, msg);
          } catch (...) {
            e = std::current_exception();
          }
        }
        fail(i, Status::Skipped, e, msg);
        cv.notify_all();
        return;
      }
      operands.push_back(operand(v, device, lock));
    }
    lock.unlock();
    NodeTiming timing;
    timing.lane = lane;
    timing.start = now();
    std::vector<c10::Storage> out;
    std::exception_ptr error;
    std::string message;
    try {
      out = run_node(node, std::move(operands), p.reuse[i]);
    } catch (const std::exception& e) {
      error = std::current_exception();
      message = e.what();
    }
    timing.end = now();
    lock.lock();
    res.timing[i] = timing;
    if (error) {
      counters().execution_errors++;
      fail(i, Status::Failed, error, message);
    } else {
      res.values[i] = std::move(out);
      res.status[i] = Status::Ok;
      // Free each graph value this node was the last to read.
      for (const auto& v : node.operands) {
        auto it = index.find(v.node.get());
        if (it == index.end()) continue;
        int d = it->second;
        if (--readers[d][v.index] == 0 && !is_root[d][v.index]) {
          res.values[d][v.index] = c10::Storage();
          for (int dev = 0; dev < static_cast<int>(p.lanes.size()); ++dev) copies.erase(std::make_tuple(d, v.index, dev));
        }
      }
    }
    lock.unlock();
    if (parallel) cv.notify_all();
  }
};

} // namespace

ExecResult execute(const ir::Graph& g, const plan::Plan& p) {
  ExecResult res;
  const size_t n = g.size();
  res.values.resize(n);
  res.status.assign(n, Status::NotRun);
  res.timing.resize(n);
  Run run(g, p, res);
  std::vector<int> busy;
  for (size_t l = 0; l < p.lane_order.size(); ++l)
    if (!p.lane_order[l].empty()) busy.push_back(static_cast<int>(l));
  if (busy.size() <= 1) {
    // One lane: run on the calling thread with all its intra-op threads.
    for (int l : busy)
      for (int i : p.lane_order[l]) run.run_one(l, i);
  } else {
    run.parallel = true;
    at::ThreadLocalState tls;  // grad mode, profiler, ... follow the work onto the lanes
    std::vector<std::function<void()>> jobs;
    for (int l : busy)
      jobs.emplace_back([&run, &p, &tls, l] {
        at::ThreadLocalStateGuard guard(tls);
        for (int i : p.lane_order[l]) run.run_one(l, i);
      });
    LanePool::instance().run(jobs, p.threads_per_lane);
  }
  res.makespan = run.now();
  return res;
}

} // namespace torch_mgpu::runtime
