// Ops that cannot be recorded run now on CPU: ops with no Meta kernel, ops
// whose output shape depends on data (nonzero, masked_select), ops that
// return Python numbers (item); and every op of a trace that runs at its
// call (engine/at_call.h). Also the copies between mgpu and the host.
#include "backend/backend.h"
#include "capture/arguments.h"
#include "capture/capture.h"
#include "capture/random.h"
#include "capture/state_lock.h"
#include "engine/at_call.h"
#include "ir/generators.h"
#include "ir/view.h"
#include "engine/engine.h"
#include "runtime/lanes.h"
#include "runtime/counters.h"
#include "runtime/host_cache.h"
#include "runtime/run_node.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/library.h>

#include <c10/util/SmallVector.h>

namespace torch_mgpu::backend {

namespace {

// Whether a write may go into the bytes of `s`'s value themselves: a host
// value that nothing else holds (no pending node reads this version, no
// other storage, host tensor or device copy shares the bytes), or no value
// yet (an empty tensor, an out= result: its bytes are made for it). Else
// the write goes into a copy.
bool sole_host_value(const c10::Storage& s) {
  const auto& n = capture::buffer_of(s)->value.node;
  if (n && n->kind == ir::NodeKind::Empty && n.use_count() == 1 && n->replicas().empty()) return true;
  // (Its own CPU tensor, host_view, holds the bytes too.)
  return n && n->kind == ir::NodeKind::Data && n.use_count() == 1 && n->data.device().is_cpu() &&
      n->data.use_count() == (n->host_view.defined() ? 2u : 1u) && n->data.nbytes() >= s.nbytes() &&
      n->replicas().empty();
}

// Whether `a` and `b` have one geometry (dtype, sizes, strides, offset,
// conj and neg bits). A CPU tensor kept for reuse (Node::host_view) is
// reused only as make_view_like would make it now: of the same geometry,
// and an inference tensor exactly when inference mode is on.
bool same_geometry(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.storage_offset() == b.storage_offset() &&
      a.sizes().equals(b.sizes()) && a.strides().equals(b.strides()) && a.is_conj() == b.is_conj() &&
      a.is_neg() == b.is_neg();
}

// Runs `op` now on the CPU (see eager_fallback), with one intra-op thread
// where `one_thread`. Random ops draw as their recording would: a
// Generator argument (given or not) becomes a CPU generator seeded from the
// mgpu one, and an op that draws from the default generator runs with it
// seeded from the mgpu one, so that a seed gives the same numbers whether a
// trace runs at its call or lazily. The arguments are read where they lie
// on the stack, `borrowed` ones too (copying a tensor Python holds would
// take the interpreter lock, capture/borrowed_args.h): the CPU kernel gets
// a stack of its own. Called by record_call, which holds the state lock and
// has typed the call's tensor lists (prepare_call).
void run_now(const capture::OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack, bool one_thread,
             capture::BorrowedArgs* borrowed) {
  TORCH_INTERNAL_ASSERT(capture::holds_state_lock(), "mgpu: an op ran at its call without the state lock");
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const c10::ArrayRef<c10::IValue> in(stack->data() + stack->size() - nargs, nargs);
  capture::check_same_device(info, op, in);
  std::optional<uint64_t> seed;
  if (capture::draws_from_default_generator(info, op, in)) seed = capture::draw_seed(std::nullopt);

  // Per mgpu storage, its CPU bytes. A written storage is written in its
  // bytes where no one else holds them (as eager writes), else into a
  // private copy; either way it then holds a new value (a new node: its
  // bytes are another version). A call has a few tensors: lists searched
  // in order, no allocation for most.
  struct Bytes {
    c10::StorageImpl* mgpu_impl;
    c10::Storage mgpu;  // the mgpu storage
    c10::Storage cpu;   // its bytes here
  };
  c10::SmallVector<Bytes, 4> bytes;
  // A written mgpu tensor (held by its caller for the call: an argument on
  // the stack, or an element of a list there) and its CPU tensor.
  struct Written {
    c10::TensorImpl* mgpu;
    at::Tensor cpu;
  };
  c10::SmallVector<Written, 2> written;
  c10::DeviceIndex device = 0;
  // The same tensor passed twice is one CPU tensor: kernels tell it from an
  // equal view (eager refuses `c[idx] = c`).
  c10::SmallVector<std::pair<c10::TensorImpl*, at::Tensor>, 4> same;
  const bool inference = c10::InferenceMode::is_enabled();
  auto to_cpu = [&](const at::Tensor& t, bool write) -> at::Tensor {
    if (!capture::is_mgpu(t)) return t;
    for (const auto& [impl, c] : same)
      if (impl == t.unsafeGetTensorImpl()) return c;
    device = t.device().index();
    auto* impl = t.storage().unsafeGetStorageImpl();
    const Bytes* b = nullptr;
    for (const auto& e : bytes)
      if (e.mgpu_impl == impl) b = &e;
    if (b == nullptr) {
      const bool in_place = write && sole_host_value(t.storage());
      c10::Storage s = engine::materialize(t.storage());
      if (write && !in_place) {
        runtime::counters().write_copies++;
        c10::Storage c = runtime::allocate(s.nbytes());
        if (s.nbytes()) std::memcpy(c.mutable_data(), s.data(), s.nbytes());
        s = c;
      }
      b = &bytes.emplace_back(Bytes{impl, t.storage(), s});
    }
    // A value read as it was made or last read (the chain `y = f(y, x)`
    // at the call): that CPU tensor again. Written ones get their own.
    ir::Node* data = nullptr;
    if (!write) {
      ir::Node* n = capture::buffer_of(t.storage())->value.node.get();
      if (n->kind == ir::NodeKind::Data && n->data.unsafeGetStorageImpl() == b->cpu.unsafeGetStorageImpl()) data = n;
    }
    at::Tensor c;
    // Another mgpu tensor of the call (an equal view) never gets the same
    // CPU tensor: kernels tell one tensor passed twice from two (torch.equal).
    auto unused = [&](const at::Tensor& v) {
      for (const auto& e : same)
        if (e.second.unsafeGetTensorImpl() == v.unsafeGetTensorImpl()) return false;
      return true;
    };
    // (A kernel that set_ a tensor it read gave it other bytes: that one is
    // not the value's any more.)
    if (data && data->host_view.defined() &&
        data->host_view.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl() == b->cpu.unsafeGetStorageImpl() &&
        same_geometry(data->host_view, t) && data->host_view.is_inference() == inference &&
        unused(data->host_view)) {
      c = data->host_view;
    } else {
      c = ir::make_view_like(b->cpu, c10::DispatchKey::CPU, t);
      if (data) data->host_view = c;
    }
    if (write) written.push_back(Written{t.unsafeGetTensorImpl(), c});
    same.emplace_back(t.unsafeGetTensorImpl(), c);
    return c;
  };
  // The CPU kernel's arguments. Written storages first, so that reads of
  // the same storage see the copy.
  c10::SmallVector<c10::IValue, 8> cpu_args(nargs);
  for (size_t i = 0; i < nargs; ++i) {
    const auto& a = schema.arguments()[i];
    if (a.alias_info() && a.alias_info()->isWrite())
      cpu_args[i] = capture::map_tensors(in[i], [&](const at::Tensor& t) { return to_cpu(t, true); });
  }
  for (size_t i = 0; i < nargs; ++i) {
    const auto& v = in[i];
    const auto& a = schema.arguments()[i];
    if (a.alias_info() && a.alias_info()->isWrite()) continue;
    if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1) {
      capture::check_device_index(v.toDevice().index());
      device = std::max<c10::DeviceIndex>(v.toDevice().index(), 0);
      cpu_args[i] = c10::Device(c10::kCPU);
    } else if (v.isGenerator() && v.toGenerator().device().type() == c10::DeviceType::PrivateUse1) {
      cpu_args[i] = at::make_generator<at::CPUGeneratorImpl>(capture::draw_seed(v.toGenerator()));
    } else if (v.isNone() && capture::is_generator(a)) {
      cpu_args[i] = at::make_generator<at::CPUGeneratorImpl>(capture::draw_seed(std::nullopt));
    } else {
      cpu_args[i] = capture::map_tensors(v, [&](const at::Tensor& t) { return to_cpu(t, false); });
    }
  }

  torch::jit::Stack s(std::make_move_iterator(cpu_args.begin()), std::make_move_iterator(cpu_args.end()));
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    // Autocast did its casts at the mgpu call: not again on the CPU.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    std::optional<runtime::ScopedParallelism> threads;
    if (one_thread) threads.emplace(1);
    // Large outputs reuse freed blocks, as on the lanes (runtime/host_cache.h).
    runtime::HostCacheScope host_memory;
    try {
      if (seed) ir::call_with_own_generator(op, s, c10::Device(c10::kCPU), *seed);
      else op.callBoxed(&s);
    } catch (...) {
      // A kernel that raised may have written part of what it writes in
      // place (as eager's does): those storages hold another version.
      for (auto& w : written) {
        auto* buf = capture::buffer_of(w.mgpu->storage());
        if (buf->value.node->kind == ir::NodeKind::Data &&
            buf->value.node->data.unsafeGetStorageImpl() == w.cpu.storage().unsafeGetStorageImpl())
          buf->value = ir::Value{ir::make_data(w.cpu.storage()), 0};
      }
      throw;
    }
  }

  // Bind written storages to their new bytes, with any new geometry.
  for (auto& w : written) {
    const c10::Storage& ms = w.mgpu->storage();
    auto* b = capture::buffer_of(ms);
    c10::Storage cs = w.cpu.storage();
    if (cs.nbytes() > ms.nbytes()) ms.unsafeGetStorageImpl()->set_nbytes(cs.nbytes());
    b->value = ir::Value{ir::make_data(cs), 0};
    const at::Tensor& c = w.cpu;  // out= and resize_ change its sizes
    if (w.mgpu->sizes() != c.sizes() || w.mgpu->strides() != c.strides() || w.mgpu->storage_offset() != c.storage_offset())
      w.mgpu->set_sizes_and_strides(c.sizes(), c.strides(), c.storage_offset());
  }
  // The results, as mgpu tensors. A written tensor returned (an in-place
  // op's, an out= op's) is its argument: borrowed again where it came
  // borrowed, else a reference of its own.
  struct Result {
    c10::IValue value;
    c10::TensorImpl* borrowed = nullptr;
  };
  auto wrap = [&](const at::Tensor& result, Result& r) {
    if (!result.defined() || !result.device().is_cpu()) {
      r.value = result;
      return;
    }
    // A ZeroTensor has no bytes behind it: its value, in bytes.
    const at::Tensor z = result._is_zerotensor() ? at::zeros(result.sizes(), result.options()) : result;
    for (auto& w : written)
      if (w.cpu.unsafeGetTensorImpl() == z.unsafeGetTensorImpl()) {
        if (borrowed && borrowed->borrows(w.mgpu)) r.borrowed = w.mgpu;
        else r.value = at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(w.mgpu));
        return;
      }
    for (const auto& b : bytes)  // a view of an input's bytes: of its mgpu storage
      if (b.cpu.unsafeGetStorageImpl() == z.storage().unsafeGetStorageImpl()) {
        r.value = ir::make_view_like(b.mgpu, c10::DispatchKey::PrivateUse1, z);
        return;
      }
    auto data = ir::make_data(z.storage());
    if (!z.unsafeGetTensorImpl()->is_wrapped_number()) data->host_view = z;  // what the next op at its call reads it as
    r.value = ir::make_view_like(capture::new_storage(z.storage().nbytes(), device, std::move(data)),
                                 c10::DispatchKey::PrivateUse1, z);
  };
  c10::SmallVector<Result, 2> results(s.size());
  for (size_t k = 0; k < s.size(); ++k) {
    const auto& v = s[k];
    if (v.isTensor()) {
      wrap(v.toTensor(), results[k]);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> l;
      for (const auto& t : v.toTensorList()) {
        Result e;
        wrap(t, e);
        // A list holds references of its own.
        l.push_back(e.borrowed ? at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(e.borrowed))
                               : std::move(e.value).toTensor());
      }
      results[k].value = l;
    } else {
      results[k].value = v;
    }
  }
  if (borrowed) borrowed->release();
  torch::jit::drop(*stack, nargs);
  for (auto& r : results) {
    if (r.borrowed) borrowed->push_again(r.borrowed);
    else stack->push_back(std::move(r.value));
  }
}

} // namespace

void eager_fallback(const capture::OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                    capture::BorrowedArgs* borrowed) {
  if (op.schema().name() != "aten::_local_scalar_dense") runtime::counters().eager_fallbacks++;
  run_now(info, op, stack, /*one_thread=*/false, borrowed);
}

void run_at_call(const capture::OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                 bool one_thread, capture::BorrowedArgs* borrowed) {
  runtime::counters().at_call_ops++;
  run_now(info, op, stack, one_thread, borrowed);
}

namespace {

const c10::OperatorHandle& copy_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  return op;
}

// Whether `self` spans its whole storage, densely, with nothing computed yet.
bool is_fresh_dense(const at::Tensor& self) {
  auto* b = capture::buffer_of(self);
  return b->value.node->kind == ir::NodeKind::Empty && self.storage_offset() == 0 &&
      self.is_contiguous() && self.nbytes() == self.storage().nbytes();
}

at::Tensor& mgpu_copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  if (capture::is_mgpu(self) && !capture::is_mgpu(src) && !src.device().is_cpu()) {
    // Another device's tensor (a CUDA one): its value comes through the
    // host, a snapshot taken now.
    return mgpu_copy_(self, src.to(at::kCPU), non_blocking);
  }
  capture::StateLock lock;
  if (capture::is_mgpu(self)) {
    if (!capture::is_mgpu(src)) {
      runtime::counters().bytes_transferred += src.nbytes();
      if (src.sizes() == self.sizes() && src.scalar_type() == self.scalar_type() && is_fresh_dense(self)) {
        // Host to mgpu into a fresh tensor: the snapshot is the value.
        at::Tensor snap = src.clone(at::MemoryFormat::Contiguous);
        capture::buffer_of(self)->value = ir::Value{ir::make_data(snap.storage()), 0};
        return self;
      }
    }
    torch::jit::Stack stack{self, src, non_blocking};
    record_call(copy_op(), &stack, /*cpu_as_meta=*/true);
    return self;
  }
  TORCH_CHECK(capture::is_mgpu(src), "mgpu: copy_ reached the mgpu backend with no mgpu tensor");
  engine::at_call::ProgramRead read;  // a copy to the host reads the program's values
  c10::Storage data = engine::materialize(src.storage());
  runtime::counters().bytes_transferred += src.nbytes();
  // One thread: an OpenMP team woken here would spin on the cores the lanes
  // are about to need at the next sync.
  runtime::ScopedParallelism one(1);
  self.copy_(runtime::cpu_view(data, capture::geometry_of(src)), non_blocking);
  return self;
}

at::Tensor mgpu_copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor d = dst;
  mgpu_copy_(d, self, non_blocking);
  return d;
}

at::Tensor mgpu_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::Tensor d = dst;
  if (d.sizes() != self.sizes()) d.resize_(self.sizes());
  mgpu_copy_(d, self, false);
  return d;
}

bool mgpu_is_pinned(const at::Tensor& self, std::optional<at::Device> device) { return false; }

// set_ rebinds a tensor to a storage: for mgpu, pure metadata (the storage's
// lazy value comes along), so no node is recorded.
void check_mgpu_storage(const at::Tensor& self, const c10::Storage& source) {
  TORCH_CHECK(source.device().type() == c10::DeviceType::PrivateUse1,
              "Attempted to set the storage of a tensor on device \"", self.device(),
              "\" to a storage on different device \"", source.device(), "\".  This is no longer allowed; the devices must match.");
  // A data-less storage (a wrapper subclass's, which views of one share
  // under no_dispatch) has no bytes to misread: reading it raises. Bytes
  // mgpu did not make (a slice of an untyped storage) are refused here, by name.
  if (!capture::is_lazy_storage(source) && source.data_ptr().get() == nullptr) return;
  (void)capture::buffer_of(source);
}

// A copy-on-write clone is a clone here: mgpu's values are versions already
// (a write makes a new one), so the copy shares nothing that could change.
at::Tensor mgpu_lazy_clone(const at::Tensor& self) { return self.clone(); }

at::Tensor& mgpu_set_storage_offset(at::Tensor& self, c10::Storage source, c10::SymInt offset, c10::SymIntArrayRef size,
                                    c10::SymIntArrayRef stride) {
  capture::StateLock lock;
  check_mgpu_storage(self, source);
  std::vector<int64_t> sizes, strides;
  for (const auto& v : size) sizes.push_back(v.expect_int());
  for (const auto& v : stride) strides.push_back(v.expect_int());
  if (strides.empty()) {
    strides.assign(sizes.size(), 1);
    for (int i = static_cast<int>(sizes.size()) - 2; i >= 0; --i)
      strides[i] = strides[i + 1] * std::max<int64_t>(sizes[i + 1], 1);
  }
  int64_t off = offset.expect_int();
  TORCH_CHECK(off >= 0, "Tensor: invalid storage offset ", off);
  // Same bounds rule as eager: the view must fit in the storage.
  int64_t extent = 0;
  bool empty = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) empty = true;
    extent += (sizes[i] - 1) * strides[i];
  }
  if (!empty) {
    int64_t need = (off + extent + 1) * static_cast<int64_t>(self.dtype().itemsize());
    TORCH_CHECK(need <= static_cast<int64_t>(source.nbytes()), "setStorage: sizes ", c10::IntArrayRef(sizes),
                ", strides ", c10::IntArrayRef(strides),
                ", storage offset ", off, ", and itemsize ", self.dtype().itemsize(), " requiring a storage size of ",
                need, " are out of bounds for storage of size ", source.nbytes());
  }
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(source);
  impl->set_sizes_and_strides(sizes, strides, off);
  return self;
}

at::Tensor& mgpu_set_storage(at::Tensor& self, c10::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  std::vector<c10::SymInt> size{c10::SymInt(n)};
  return mgpu_set_storage_offset(self, std::move(source), 0, size, {});
}

at::Tensor& mgpu_set_tensor(at::Tensor& self, const at::Tensor& source) {
  TORCH_CHECK(capture::is_mgpu(source), "Attempted to set the storage of a tensor on device \"", self.device(),
              "\" to a storage on different device \"", source.device(), "\".  This is no longer allowed; the devices must match.");
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  TORCH_CHECK(self.dtype() == source.dtype(), "Could not set tensor of type ", source.dtype(), " to a tensor of type ",
              self.dtype());
  std::vector<c10::SymInt> size(source.sizes().begin(), source.sizes().end());
  std::vector<c10::SymInt> stride(source.strides().begin(), source.strides().end());
  return mgpu_set_storage_offset(self, source.storage(), source.storage_offset(), size, stride);
}

at::Tensor& mgpu_set_empty(at::Tensor& self) {
  capture::StateLock lock;
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(capture::new_storage(0, self.device().index()));
  impl->set_sizes_contiguous({0});
  return self;
}

} // namespace
} // namespace torch_mgpu::backend

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("copy_", TORCH_FN(torch_mgpu::backend::mgpu_copy_));
  m.impl("_copy_from", TORCH_FN(torch_mgpu::backend::mgpu_copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(torch_mgpu::backend::mgpu_copy_from_and_resize));
  m.impl("is_pinned", TORCH_FN(torch_mgpu::backend::mgpu_is_pinned));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(torch_mgpu::backend::mgpu_set_storage_offset));
  m.impl("set_.source_Storage", TORCH_FN(torch_mgpu::backend::mgpu_set_storage));
  m.impl("set_.source_Tensor", TORCH_FN(torch_mgpu::backend::mgpu_set_tensor));
  m.impl("set_", TORCH_FN(torch_mgpu::backend::mgpu_set_empty));
  m.impl("_lazy_clone", TORCH_FN(torch_mgpu::backend::mgpu_lazy_clone));
}
