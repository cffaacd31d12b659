// Recurrent layers and cells: their composites take one path on the CPU and
// another on any other device, and the two part in the last places.
//
// - lstm: the CPU runs oneDNN's fused kernel (float32, bfloat16); elsewhere
//   a loop of fused cells (3e-8 apart in float32, 2e-3 in bfloat16).
// - gru, rnn_tanh, rnn_relu: the CPU computes every step's input projection
//   in one matrix product before the loop; elsewhere one per step, and gru's
//   cells are fused ones (6e-8 apart in float32, 3e-3 in bfloat16).
// - The same layers over packed sequences (the `.data` overloads).
// - lstm_cell, gru_cell: the CPU composes them of addmm and pointwise ops;
//   elsewhere one fused kernel (2e-3 apart in bfloat16).
//
// Without a gradient wanted each is recorded whole: one node, which the
// lanes run with their device's own kernel (the CPU's path on CPU lanes:
// eager's values). With a gradient wanted the composite runs (autograd needs
// its parts), as before, and keeps that difference (gradients of the input
// projections: 5e-7 in float32).
#include "backend/backend.h"

#include <ATen/RedispatchFunctions.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/stack.h>
#include <ATen/ops/gru_cell_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/gru_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/lstm_cell_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/lstm_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/rnn_relu_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/rnn_tanh_compositeimplicitautograd_dispatch.h>
#include <torch/library.h>

#include <tuple>
#include <utility>

namespace torch_mgpu::backend {
namespace {

// Whether an argument makes the call take the composite (backend.h's test,
// over every tensor of the call).
using backend::takes_composite;
bool takes_composite(at::TensorList list) {
  for (const at::Tensor& t : list)
    if (takes_composite(t)) return true;
  return false;
}
bool takes_composite(const std::optional<at::Tensor>& t) { return t.has_value() && takes_composite(*t); }
template <typename T>
bool takes_composite(const T&) {
  return false;  // numbers and flags
}

template <typename Result>
struct Returns;
template <>
struct Returns<at::Tensor> {
  static at::Tensor from(torch::jit::Stack& stack) { return std::move(stack.at(0)).toTensor(); }
};
template <typename... T>
struct Returns<std::tuple<T...>> {
  static std::tuple<T...> from(torch::jit::Stack& stack) { return take(stack, std::index_sequence_for<T...>{}); }
  template <size_t... I>
  static std::tuple<T...> take(torch::jit::Stack& stack, std::index_sequence<I...>) {
    return {std::move(stack.at(I)).toTensor()...};
  }
};

constexpr char kLstm[] = "aten::lstm";
constexpr char kGru[] = "aten::gru";
constexpr char kRnnTanh[] = "aten::rnn_tanh";
constexpr char kRnnRelu[] = "aten::rnn_relu";
constexpr char kLstmCell[] = "aten::lstm_cell";
constexpr char kGruCell[] = "aten::gru_cell";
constexpr char kInput[] = "input";
constexpr char kData[] = "data";
constexpr char kNone[] = "";

// One op: `Composite` (at::compositeimplicitautograd's) with a gradient
// wanted, else the op recorded whole (`Name`, `Overload`).
template <typename Fn, Fn* Composite, typename RedispatchFn, RedispatchFn* Redispatch, const char* Name,
          const char* Overload>
struct WholeWithoutGradient;

template <typename Result, typename... Args, Result (*Composite)(Args...), typename RedispatchFn,
          RedispatchFn* Redispatch, const char* Name, const char* Overload>
struct WholeWithoutGradient<Result(Args...), Composite, RedispatchFn, Redispatch, Name, Overload> {
  static bool composite(const Args&... args) {
    // A packed sequence's batch sizes stay on the host (the composite reads
    // their bytes there): refused elsewhere, as on CUDA.
    if constexpr (Overload == kData)
      TORCH_CHECK(std::get<1>(std::forward_as_tuple(args...)).device().is_cpu(),
                  "batch_sizes should always be on CPU. Instances of PackedSequence should never be created manually. "
                  "They should be instantiated by functions like pack_sequence and pack_padded_sequences in "
                  "nn.utils.rnn. https://pytorch.org/docs/stable/nn.html#torch.nn.utils.rnn.pack_sequence");
    return (takes_composite(args) || ...);
  }

  // AutogradPrivateUse1.
  static Result autograd(c10::DispatchKeySet ks, Args... args) {
    if (composite(args...)) return Composite(args...);
    at::AutoDispatchBelowADInplaceOrView guard;
    return Redispatch(below_autograd(ks), args...);
  }

  // PrivateUse1 (registered by name: a composite kernel counts as the
  // backend's own, so the boxed fallback would not be reached).
  static Result below(Args... args) {
    if (composite(args...)) return Composite(args...);
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(Name, Overload);
    torch::jit::Stack stack;
    torch::jit::push(stack, args...);
    mgpu_fallback(op, &stack);
    return Returns<Result>::from(stack);
  }
};

using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using OptTensor = std::optional<at::Tensor>;

// The signatures, as ATen's kernels take them.
using Lstm = Tensor3(const at::Tensor&, at::TensorList, at::TensorList, bool, int64_t, double, bool, bool, bool);
using Layer = Tensor2(const at::Tensor&, const at::Tensor&, at::TensorList, bool, int64_t, double, bool, bool, bool);
using PackedLstm = Tensor3(const at::Tensor&, const at::Tensor&, at::TensorList, at::TensorList, bool, int64_t, double,
                           bool, bool);
using PackedLayer = Tensor2(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList, bool, int64_t,
                            double, bool, bool);
using LstmCell = Tensor2(const at::Tensor&, at::TensorList, const at::Tensor&, const at::Tensor&, const OptTensor&,
                         const OptTensor&);
using GruCell = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const OptTensor&, const OptTensor&);
template <typename Fn>
struct WithKeys;
template <typename R, typename... A>
struct WithKeys<R(A...)> {
  using type = R(c10::DispatchKeySet, A...);
};

#define TORCH_MGPU_WHOLE(Sig, fn, name, overload)                                                               \
  WholeWithoutGradient<Sig, static_cast<Sig*>(&at::compositeimplicitautograd::fn), WithKeys<Sig>::type,       \
                       static_cast<WithKeys<Sig>::type*>(&at::redispatch::fn), name, overload>

using LstmKernels = TORCH_MGPU_WHOLE(Lstm, lstm, kLstm, kInput);
using GruKernels = TORCH_MGPU_WHOLE(Layer, gru, kGru, kInput);
using RnnTanhKernels = TORCH_MGPU_WHOLE(Layer, rnn_tanh, kRnnTanh, kInput);
using RnnReluKernels = TORCH_MGPU_WHOLE(Layer, rnn_relu, kRnnRelu, kInput);
using PackedLstmKernels = TORCH_MGPU_WHOLE(PackedLstm, lstm, kLstm, kData);
using PackedGruKernels = TORCH_MGPU_WHOLE(PackedLayer, gru, kGru, kData);
using PackedRnnTanhKernels = TORCH_MGPU_WHOLE(PackedLayer, rnn_tanh, kRnnTanh, kData);
using PackedRnnReluKernels = TORCH_MGPU_WHOLE(PackedLayer, rnn_relu, kRnnRelu, kData);
using LstmCellKernels = TORCH_MGPU_WHOLE(LstmCell, lstm_cell, kLstmCell, kNone);
using GruCellKernels = TORCH_MGPU_WHOLE(GruCell, gru_cell, kGruCell, kNone);

#undef TORCH_MGPU_WHOLE

} // namespace
} // namespace torch_mgpu::backend

#define TORCH_MGPU_RNN_KERNELS(m, kernel)                                                   \
  m.impl("lstm.input", TORCH_FN(torch_mgpu::backend::LstmKernels::kernel));                \
  m.impl("gru.input", TORCH_FN(torch_mgpu::backend::GruKernels::kernel));                  \
  m.impl("rnn_tanh.input", TORCH_FN(torch_mgpu::backend::RnnTanhKernels::kernel));         \
  m.impl("rnn_relu.input", TORCH_FN(torch_mgpu::backend::RnnReluKernels::kernel));         \
  m.impl("lstm.data", TORCH_FN(torch_mgpu::backend::PackedLstmKernels::kernel));          \
  m.impl("gru.data", TORCH_FN(torch_mgpu::backend::PackedGruKernels::kernel));            \
  m.impl("rnn_tanh.data", TORCH_FN(torch_mgpu::backend::PackedRnnTanhKernels::kernel));   \
  m.impl("rnn_relu.data", TORCH_FN(torch_mgpu::backend::PackedRnnReluKernels::kernel));   \
  m.impl("lstm_cell", TORCH_FN(torch_mgpu::backend::LstmCellKernels::kernel));             \
  m.impl("gru_cell", TORCH_FN(torch_mgpu::backend::GruCellKernels::kernel))

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) { TORCH_MGPU_RNN_KERNELS(m, autograd); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) { TORCH_MGPU_RNN_KERNELS(m, below); }
