#include "runtime/executor.h"
#include "stats.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>

#include <chrono>
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

ir::TensorGeometry geometry_of_cpu(const at::Tensor& t) {
  return ir::TensorGeometry{t.scalar_type(), t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.is_conj(),
                            t.is_neg()};
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
    at::AutoDispatchBelowADInplaceOrView guard;
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
    } else if (aliases || geometry_of_cpu(r) != o.geom || r.storage().nbytes() < o.nbytes) {
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

ExecResult execute(const ir::Graph& g, const plan::Plan& p) {
  ExecResult res;
  const size_t n = g.size();
  res.values.resize(n);
  res.status.assign(n, Status::NotRun);
  res.timing.resize(n);
  std::unordered_map<const ir::Node*, int> index;
  for (size_t i = 0; i < n; ++i) index[g.nodes[i].get()] = static_cast<int>(i);

  auto t0 = std::chrono::steady_clock::now();
  auto now = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  for (size_t lane = 0; lane < p.lane_order.size(); ++lane) {
    for (int i : p.lane_order[lane]) {
      const ir::Node& node = *g.nodes[i];
      std::vector<c10::Storage> operands;
      operands.reserve(node.operands.size());
      bool ready = true;
      std::string missing;
      for (const auto& v : node.operands) {
        auto it = index.find(v.node.get());
        if (it != index.end()) {
          if (res.status[it->second] != Status::Ok) {
            ready = false;
            break;
          }
          operands.push_back(res.values[it->second][v.index]);
        } else if (v.node->kind == ir::NodeKind::Data) {
          operands.push_back(v.node->data);
        } else if (v.node->kind == ir::NodeKind::Empty) {
          operands.push_back(allocate(v.node->outputs[0].nbytes));
        } else {
          ready = false;  // an Error value: this node cannot compute
          missing = v.node->error;
          break;
        }
      }
      if (!ready) {
        res.status[i] = Status::Skipped;
        if (!missing.empty() && !res.first_error) {
          res.first_message = missing;
          try {
            TORCH_CHECK(false, missing);
          } catch (...) {
            res.first_error = std::current_exception();
          }
        }
        continue;
      }
      res.timing[i].lane = static_cast<int>(lane);
      res.timing[i].start = now();
      try {
        res.values[i] = run_node(node, std::move(operands), p.reuse[i]);
        res.status[i] = Status::Ok;
      } catch (const std::exception& e) {
        res.status[i] = Status::Failed;
        counters().execution_errors++;
        if (!res.first_error) {
          res.first_error = std::current_exception();
          res.first_message = e.what();
        }
        res.timing[i].end = now();
        continue;
      }
      res.timing[i].end = now();
      for (const auto& [prod, out] : p.free_after[i]) res.values[prod][out] = c10::Storage();
    }
  }
  res.makespan = now();
  return res;
}

} // namespace torch_mgpu::runtime
