// One node run at its place: its operands as CPU or device tensors, its
// kernel called under the settings of its call, its results laid out as
// recorded.
#include "runtime/run_node.h"
#include "ir/call_state.h"
#include "ir/generators.h"
#include "runtime/counters.h"
#include "runtime/observer.h"

#include <ATen/record_function.h>
#include <c10/core/StreamGuard.h>

#include <optional>

namespace torch_mgpu::runtime {

at::Tensor cpu_view(const c10::Storage& storage, const ir::TensorGeometry& geom) {
  return ir::make_view(storage, c10::DispatchKey::CPU, geom);
}

namespace {

bool same_geometry(const at::Tensor& t, const ir::TensorGeometry& g) {
  return t.scalar_type() == g.dtype && t.sizes() == c10::IntArrayRef(g.sizes) &&
      t.strides() == c10::IntArrayRef(g.strides) && t.storage_offset() == g.offset && t.is_conj() == g.conj &&
      t.is_neg() == g.neg;
}

// A tensor argument over the operands' bytes; a tensor the call was passed
// more than once is one tensor here too (`same`: those made so far).
c10::IValue tensor_ivalue(const std::optional<ir::TensorRef>& r, const std::vector<c10::Storage>& s,
                          std::vector<at::Tensor>& same) {
  if (!r) return c10::IValue();
  if (r->same < 0) return view(s[r->operand], r->geom);
  if (static_cast<size_t>(r->same) >= same.size()) same.resize(r->same + 1);
  if (!same[r->same].defined()) same[r->same] = view(s[r->operand], r->geom);
  return same[r->same];
}

// Capture records the mgpu device as "cpu" and generators as seeded CPU
// generators; on another device they become that device and a generator of
// it with the same seed.
c10::IValue constant_at(const c10::IValue& v, const Place& place) {
  if (place.device.is_cpu()) return v;
  if (v.isDevice() && v.toDevice().is_cpu()) return place.device;
  if (v.isGenerator() && v.toGenerator().device().is_cpu()) {
    at::Generator g = at::globalContext().defaultGenerator(place.device).clone();
    g.set_current_seed(v.toGenerator().current_seed());
    return g;
  }
  return v;
}

} // namespace

std::string describe_node(const ir::Node& n) {
  std::string s = std::string(n.name) + " (op #" + std::to_string(n.id);
  if (!n.where.empty()) s += ", called at " + std::string(n.where);
  return s + ")";
}

// Recording chose some ops for a device that is not CUDA:
// scaled_dot_product_attention on mgpu picks
// _scaled_dot_product_flash_attention_for_cpu, which CUDA lacks.
bool runs_on(const ir::Node& n, const Place& place) {
  if (!place.device.is_cuda() || !n.op) return true;
  return n.op->hasComputedKernelForDispatchKey(c10::DispatchKey::CUDA);
}

namespace {

// Such an op runs on the host, as eager CPU runs it: its operands copied
// there (the lane's stream finishes what it owes them first), its outputs
// copied back to the lane's device.
std::vector<c10::Storage> run_on_host(const ir::Node& n, const std::vector<c10::Storage>& operands,
                                      const Place& place) {
  counters().host_nodes++;
  std::vector<c10::Storage> host;
  host.reserve(operands.size());
  for (const auto& s : operands) host.push_back(copy_to(s, c10::Device(c10::kCPU), /*wait=*/true));
  const Place cpu;  // the host, no stream
  std::vector<c10::Storage> out = run_node(n, std::move(host), std::vector<bool>(operands.size(), true), cpu);
  for (auto& s : out)
    if (s.unsafeGetStorageImpl()) s = copy_to(s, place.device, /*wait=*/true);
  return out;
}
} // namespace

namespace {
// The op's arguments on `stack`: constants as the lane takes them, tensors
// as views of their operands' bytes (`same`: the tensors already made, one
// per operand geometry, so that an op sees aliasing arguments alias).
void push_arguments(const ir::Node& n, const std::vector<c10::Storage>& operands, const Place& place,
                    torch::jit::Stack& stack, std::vector<at::Tensor>& same) {
  for (const auto& a : n.args) {
    switch (a.kind) {
      case ir::Arg::Kind::Constant:
        stack.push_back(constant_at(a.constant, place));
        break;
      case ir::Arg::Kind::Tensor:
        stack.push_back(tensor_ivalue(a.tensors[0], operands, same));
        break;
      case ir::Arg::Kind::TensorList: {
        c10::List<at::Tensor> l;
        for (const auto& r : a.tensors) l.push_back(tensor_ivalue(r, operands, same).toTensor());
        stack.emplace_back(l);
        break;
      }
      case ir::Arg::Kind::OptionalTensorList: {
        c10::List<std::optional<at::Tensor>> l;
        for (const auto& r : a.tensors)
          l.push_back(r ? std::optional<at::Tensor>(tensor_ivalue(r, operands, same).toTensor()) : std::nullopt);
        stack.emplace_back(l);
        break;
      }
    }
  }
}

} // namespace

namespace {

// Calls the op's kernel on `stack` as eager would have at the call: below
// autograd, with the caller's grad mode, no autocast again, no warnings
// (given at the call), a seeded op's generator seeded and put back.
void call_kernel(const ir::Node& n, torch::jit::Stack& stack, const Place& place) {
  {
    RECORD_FUNCTION("mgpu::" + std::string(n.name), std::vector<c10::IValue>());
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    c10::AutoGradMode grad_mode(n.grad_mode);  // the caller's, as eager's kernel would see it
    // Autocast did its casts when the op was recorded; the lane's thread
    // carries the syncing thread's autocast state, which must not apply again.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    // The op's warnings were given at its call (by its Meta kernel or the
    // probe, capture/probe.cpp); a lane has no caller to give them to.
    c10::WarningUtils::WarningHandlerGuard no_warnings(&ir::silent_warnings());
    if (n.seed) ir::call_with_own_generator(*n.op, stack, place.device, *n.seed);
    else n.op->callBoxed(&stack);
  }
}

// Written arguments end with the geometry the mgpu tensors took at the
// call (Meta's). A CPU kernel that resized its out= argument may have
// given it another layout (kept its input's strides): its values are moved
// into the recorded geometry, so that the bytes mean what the mgpu tensor
// says they mean.
void keep_written_layouts(const ir::Node& n, const std::vector<at::Tensor>& written,
                          std::vector<c10::Storage>& operands, const Place& place) {
  for (size_t k = 0; k < n.written.size(); ++k) {
    const at::Tensor& t = written[k];
    const auto& want = n.written[k].after;
    if (same_geometry(t, want)) continue;
    TORCH_CHECK(t.sizes() == c10::IntArrayRef(want.sizes) && t.scalar_type() == want.dtype, "mgpu: ", n.name,
                " left its output with shape ", t.sizes(), " and dtype ", t.scalar_type(),
                " where its Meta kernel promised ", c10::IntArrayRef(want.sizes), " and ", want.dtype);
    const auto& a = n.args[n.written[k].arg];
    const auto& ref = a.tensors[n.written[k].element < 0 ? 0 : n.written[k].element];
    TORCH_INTERNAL_ASSERT(ref.has_value(), "mgpu: a written argument of ", n.name, " has no tensor");
    at::Tensor values = t.clone();
    c10::Storage& bytes = operands[ref->operand];
    const size_t need = (at::detail::computeStorageNbytes(want.sizes, want.strides, c10::elementSize(want.dtype)) +
                         static_cast<size_t>(want.offset) * c10::elementSize(want.dtype));
    if (bytes.nbytes() < need) {
      c10::Storage grown = allocate(need, place.device);
      if (bytes.nbytes()) byte_view(grown, bytes.nbytes()).copy_(byte_view(bytes, bytes.nbytes()));
      bytes = grown;
    }
    view(bytes, want).copy_(values);
  }
}

// The bytes of each output: a written operand's, or a returned tensor's
// (copied where its layout, its shape or its aliasing is not what Meta
// promised; zeros where the kernel returned none, or an empty auxiliary).
std::vector<c10::Storage> output_bytes(const ir::Node& n, const std::vector<at::Tensor>& returned,
                                       const std::vector<c10::Storage>& operands, const Place& place) {
  std::vector<c10::Storage> out;
  out.reserve(n.outputs.size());
  for (const auto& o : n.outputs) {
    if (o.mutated_operand >= 0) {
      out.push_back(operands[o.mutated_operand]);
      continue;
    }
    TORCH_INTERNAL_ASSERT(o.returned >= 0 && o.returned < static_cast<int>(returned.size()));
    const at::Tensor& r = returned[o.returned];
    if (!r.defined()) {
      // No tensor where Meta's kernel returned one (native_batch_norm_backward
      // leaves out the input's gradient when the input needs none): zeros
      // of the recorded geometry, a value nothing reads.
      c10::Storage fresh = allocate(o.nbytes, place.device);
      zero(fresh);
      out.push_back(fresh);
      continue;
    }
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
      c10::Storage fresh = allocate(o.nbytes, place.device);
      zero(fresh);
      out.push_back(fresh);
    } else if (r._is_zerotensor() || (r.storage().nbytes() > 0 && !r.storage().data())) {
      // A ZeroTensor (autograd's `_efficientzerotensor`: zeros with no
      // bytes behind them): its value, in bytes.
      c10::Storage fresh = allocate(o.nbytes, place.device);
      zero(fresh);
      out.push_back(fresh);
    } else if (aliases || !same_geometry(r, o.geom) || r.storage().nbytes() < o.nbytes) {
      c10::Storage fresh = allocate(o.nbytes, place.device);
      view(fresh, o.geom).copy_(r);
      out.push_back(fresh);
    } else {
      out.push_back(r.storage());
    }
  }
  return out;
}
} // namespace

std::vector<c10::Storage> run_node(const ir::Node& n, std::vector<c10::Storage> operands,
                                   const std::vector<bool>& reuse, const Place& place) {
  if (!runs_on(n, place)) return run_on_host(n, operands, place);
  // Stream lanes watched by an observer (the sanitizer): what the node's
  // work on its stream reads.
  std::vector<const void*> stream_reads;
  const bool watched = place.on_stream() && observers().watches_streams();
  if (watched)
    for (const auto& s : operands) stream_reads.push_back(s.data());
  // Each operand a distinct storage; writes go to a private copy unless the
  // plan proved this node the value's only reader.
  for (const auto& o : n.outputs)
    if (o.mutated_operand >= 0 && !reuse[o.mutated_operand])
      operands[o.mutated_operand] = copy_to(operands[o.mutated_operand], operands[o.mutated_operand].device());

  // Scratch kept per thread (no allocation per node); emptied on the way
  // out so that no tensor outlives the call.
  thread_local torch::jit::Stack stack;
  thread_local std::vector<at::Tensor> returned;
  thread_local std::vector<at::Tensor> written;  // the views the op writes, as passed to it
  struct Clear {
    ~Clear() {
      stack.clear();
      returned.clear();
      written.clear();
    }
  } clear_on_exit;
  stack.clear();
  returned.clear();
  written.clear();
  std::vector<at::Tensor> same;
  push_arguments(n, operands, place, stack, same);
  for (const auto& w : n.written) {
    const c10::IValue& v = stack[w.arg];
    written.push_back(w.element < 0 ? v.toTensor() : v.toTensorList().get(w.element));
  }
  call_kernel(n, stack, place);
  keep_written_layouts(n, written, operands, place);
  // Flatten the returned tensors.
  for (const auto& v : stack) {
    if (v.isTensor()) returned.push_back(v.toTensor());
    else if (v.isTensorList())
      for (const auto& t : v.toTensorList()) returned.push_back(t);
    else
      returned.emplace_back();
  }
  std::vector<c10::Storage> out = output_bytes(n, returned, operands, place);
  if (watched) {
    std::vector<const void*> writes;
    for (const auto& s : out) writes.push_back(s.data());
    observers().stream_access(place.device, "node " + std::to_string(n.id) + " (" + std::string(n.name) + ")",
                              stream_reads, writes, /*synchronous=*/false);
  }
  observers().nodes_ran(1);
  return out;
}

} // namespace torch_mgpu::runtime
