// Unboxed kernels for the commonest ops: the same recording as the boxed
// fallback, without the dispatcher's boxing copies.
//
// A call that reaches a boxed kernel has each tensor argument copied into
// the stack; for a tensor Python holds, that copy and its release each take
// the interpreter lock (PyObject preservation: refcount 1 -> 2 increfs the
// Python object, 2 -> 1 decrefs it), about a tenth of a tiny op's capture.
// These kernels receive `const Tensor&`, put the tensors on the stack
// borrowed (capture/borrowed_args.h) and call the same record_call.
#include "backend/backend.h"
#include "capture/borrowed_args.h"

#include <ATen/Operators.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

namespace torch_mgpu::backend {
namespace {

template <class Op, class Sig = typename Op::schema>
struct Borrowing;

template <class Op, class R, class... A>
struct Borrowing<Op, R(A...)> {
  static_assert(std::is_same_v<R, at::Tensor> || std::is_same_v<R, at::Tensor&>,
                "borrowing kernels return one tensor (in-place ops: their first argument; out= ops: their last)");
  static inline std::optional<c10::OperatorHandle> handle;

  static R call(A... args) {
    torch::jit::Stack stack;
    stack.reserve(sizeof...(A));
    capture::BorrowedArgs borrowed(&stack);  // released before the stack is destroyed
    (borrowed.push(std::forward<A>(args)), ...);
    record_call(*handle, &stack, /*cpu_as_meta=*/false, &borrowed);
    if constexpr (std::is_same_v<R, at::Tensor>) {
      return std::move(stack.back()).toTensor();
    } else if constexpr (std::is_same_v<std::tuple_element_t<0, std::tuple<A...>>, at::Tensor&>) {
      // In-place ops return the tensor they write, their first argument
      // (what the dispatcher's boxed wrapper returns for them too).
      return std::get<0>(std::forward_as_tuple(args...));
    } else {
      // out= ops return their out= tensor, their last argument.
      static_assert(std::is_same_v<std::tuple_element_t<sizeof...(A) - 1, std::tuple<A...>>, at::Tensor&>,
                    "borrowing kernels of out= ops return their last argument");
      return std::get<sizeof...(A) - 1>(std::forward_as_tuple(args...));
    }
  }
};

// Whether a call of `op` on mgpu tensors reaches the boxed fallback (or the
// boxed kernel fallback.cpp registers for composite ops with CPU and Meta
// kernels: takes_over_composite): only then does a borrowing kernel take its
// place. An op with a PrivateUse1 kernel of its own, or a composite kernel
// mgpu keeps (autograd and decompositions happen above the backend), is
// left as it is. Kernels that files linked after fallback.cpp register
// (static initialization runs in link order) are not seen here: none of
// them is for a listed op.
bool reaches_fallback(const c10::OperatorHandle& op) {
  using K = c10::DispatchKey;
  if (op.hasKernelForDispatchKey(K::PrivateUse1) || op.hasKernelForDispatchKey(K::CompositeImplicitAutograd))
    return false;
  const bool composite = op.hasKernelForDispatchKey(K::CompositeExplicitAutograd) ||
                         op.hasKernelForDispatchKey(K::CompositeExplicitAutogradNonFunctional);
  return !composite || takes_over_composite(op);
}

template <class Op>
void add_kernel(torch::Library& lib) {
  auto op = c10::Dispatcher::singleton().findSchema({Op::name, Op::overload_name});
  if (!op || !reaches_fallback(*op)) return;
  Borrowing<Op>::handle = *op;
  std::string name = std::string(Op::name).substr(6);  // past "aten::"
  if (*Op::overload_name) name += std::string(".") + Op::overload_name;
  lib.impl(name.c_str(), torch::CppFunction::makeFromUnboxedFunction(TORCH_FN(Borrowing<Op>::call)));
}

} // namespace

// Ops with a PrivateUse1 kernel from an unboxed call site (a composite's
// out= call included: abs is empty + abs.out). Not listed: ops
// with only a composite kernel (views, clone, the .Scalar overloads of the
// arithmetic ops: their composites call the ops below), which never reach
// the backend as themselves, and ops returning several tensors.
#define TORCH_MGPU_BORROWING_OPS(X)                                                                                \
  X(add_Tensor) X(add__Tensor) X(sub_Tensor) X(sub__Tensor) X(rsub_Tensor) X(mul_Tensor) X(mul__Tensor)           \
  X(div_Tensor) X(div__Tensor) X(div_Tensor_mode) X(pow_Tensor_Scalar) X(pow_Tensor_Tensor) X(maximum)            \
  X(minimum) X(remainder_Tensor) X(eq_Tensor) X(eq_Scalar) X(ne_Tensor) X(ne_Scalar) X(lt_Tensor) X(lt_Scalar)    \
  X(le_Tensor) X(le_Scalar) X(gt_Tensor) X(gt_Scalar) X(ge_Tensor) X(ge_Scalar) X(where_self) X(neg) X(exp)       \
  X(log) X(sqrt) X(rsqrt) X(tanh) X(sigmoid) X(relu) X(relu_) X(sin) X(cos) X(erf) X(reciprocal) X(floor)         \
  X(ceil) X(round) X(sign) X(log1p) X(expm1) X(clamp) X(clamp_min) X(clamp_max) X(gelu) X(silu) X(leaky_relu)     \
  X(softplus) X(hardtanh) X(elu) X(tanh_) X(sigmoid_) X(exp_) X(neg_) X(sum_dim_IntList) X(mean_dim) X(amax)      \
  X(amin) X(argmax) X(argmin) X(prod) X(_softmax) X(_log_softmax) X(var_correction) X(std_correction)             \
  X(linalg_vector_norm) X(mm) X(bmm) X(addmm) X(baddbmm) X(dot) X(fill__Scalar) X(zero_) X(masked_fill__Scalar)   \
  X(index_select) X(gather) X(abs_out) X(mul_out) X(lerp__Scalar) X(addcmul_) X(addcdiv_) X(gelu_backward)        \
  X(threshold_backward)

void register_borrowing_kernels(torch::Library& lib) {
#define TORCH_MGPU_ADD_KERNEL(op) add_kernel<at::_ops::op>(lib);
  TORCH_MGPU_BORROWING_OPS(TORCH_MGPU_ADD_KERNEL)
#undef TORCH_MGPU_ADD_KERNEL
}

} // namespace torch_mgpu::backend
