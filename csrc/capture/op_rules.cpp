// Per-op rules: what recording asks of an operator, worked out once per
// operator (OpInfo, op_info), and the checks and rewrites a call gets before
// it is recorded (prepare_call, check_same_device).
#include "capture/record_steps.h"
#include "ir/call_state.h"

#include <unordered_map>
#include <unordered_set>

namespace torch_mgpu::capture {
namespace {

using ir::Arg;
using ir::TensorGeometry;

// Ops decided before shape inference: they need data (item, nonzero), or
// return something other than tensors.
bool needs_eager(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  // Meta kernels that promise other output shapes than CPU delivers.
  static const std::unordered_set<std::string> meta_disagrees = {"aten::_embedding_bag_forward_only",
                                                                 "aten::_embedding_bag"};
  if (meta_disagrees.count(schema.name())) return true;
  if (op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output))
    return true;
  if (schema.returns().empty()) {
    bool writes = false;
    for (const auto& a : schema.arguments())
      if (a.alias_info() && a.alias_info()->isWrite()) writes = true;
    return !writes;  // asserts and the like: run them now
  }
  for (const auto& r : schema.returns()) {
    const auto& t = r.type();
    if (t->kind() == c10::TypeKind::TensorType) continue;
    if (t->kind() == c10::TypeKind::ListType &&
        t->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::TensorType)
      continue;
    if (t->kind() == c10::TypeKind::OptionalType &&
        t->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType)
      continue;
    return true;
  }
  return false;
}

bool makes_sparse(const std::string& name) {
  for (const char* prefix : {"aten::to_sparse", "aten::_to_sparse", "aten::sparse_", "aten::_sparse_"})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

bool makes_nested(const std::string& name) {
  return name.rfind("aten::_nested_", 0) == 0 || name.rfind("aten::nested_", 0) == 0;
}

bool is_empty_factory(const c10::OperatorHandle& op) {
  const auto& n = op.schema().operator_name();
  return n.name == "aten::empty_strided" || (n.name == "aten::empty" && n.overload_name == "memory_format");
}

const OpInfo& op_info(const c10::OperatorHandle& op) {
  static auto* infos = new std::unordered_map<const c10::FunctionSchema*, OpInfo>();
  const auto& schema = op.schema();
  auto it = infos->find(&schema);
  if (it != infos->end()) return it->second;
  static const std::unordered_set<std::string> host_indices = {
      "aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::_unsafe_index",
      "aten::_unsafe_index_put", "aten::index_fill", "aten::index_fill_"};
  std::string n = schema.operator_name().name;
  if (!schema.overload_name().empty()) n += "." + schema.overload_name();
  OpInfo info;
  info.name = ir::intern(n);
  info.eager = needs_eager(op);
  info.random = has_generator_arg(schema);
  info.seeded_default = !info.random && op.hasTag(at::Tag::nondeterministic_seeded);
  info.empty_factory = is_empty_factory(op);
  info.host_indices = host_indices.count(schema.name()) > 0;
  // Measured: 1 and 2 intra-op threads give other bits for these CPU kernels
  // (test_conformance). Matrix products may too (MKL splits a long inner
  // dimension), but run on fewer threads by design: that is what lets
  // branches of products run side by side (docs/ARCHITECTURE.md).
  static const std::unordered_set<std::string> thread_sensitive = {
      "aten::native_layer_norm_backward", "aten::native_batch_norm", "aten::native_batch_norm_backward",
      "aten::_native_batch_norm_legit", "aten::_native_batch_norm_legit_functional",
      "aten::_native_batch_norm_legit_no_training", "aten::prod"};
  info.thread_sensitive = thread_sensitive.count(schema.name()) > 0;
  info.host_batch_sizes = schema.overload_name() == "data" &&
      (schema.name() == "aten::lstm" || schema.name() == "aten::gru" || schema.name() == "aten::rnn_tanh" ||
       schema.name() == "aten::rnn_relu");
  info.aten = n.rfind("aten::", 0) == 0;
  info.makes_quantized = schema.name().rfind("aten::quantize_per", 0) == 0 ||
      schema.name().rfind("aten::_make_per_", 0) == 0 || schema.name() == "aten::_empty_affine_quantized" ||
      schema.name() == "aten::_empty_per_channel_affine_quantized";
  // pow(Scalar, Tensor) allocates its result before it redispatches to
  // TensorIterator: contiguous in eager, the exponent's layout on Meta.
  // max_pool1d: see backend/cpu_paths.cpp (CPU's own kernel, contiguous).
  info.contiguous_result = n == "aten::pow.Scalar" || n == "aten::max_pool1d";
  // angle of a complex tensor: an empty result resized by angle.out
  // (contiguous); of a real one, TensorIterator's (the input's layout).
  info.contiguous_if_complex = n == "aten::angle";
  info.nansum = schema.name() == "aten::nansum";
  info.makes_sparse = makes_sparse(schema.name());
  info.makes_nested = makes_nested(schema.name());
  info.pointwise = !ir::reads_matmul_precision(op);
  static const std::unordered_set<std::string> scaling = {"aten::add",     "aten::add_",     "aten::sub",
                                                          "aten::sub_",    "aten::rsub",     "aten::addcdiv",
                                                          "aten::addcdiv_", "aten::addcmul", "aten::addcmul_"};
  if (scaling.count(schema.name()) > 0) {
    const auto& formals = schema.arguments();
    for (size_t i = 0; i < formals.size() && i < 32; ++i)
      if ((formals[i].name() == "alpha" || formals[i].name() == "value") &&
          formals[i].type()->kind() == c10::TypeKind::NumberType)
        info.scale_args |= uint32_t{1} << i;
  }
  for (const auto& a : schema.arguments()) {
    auto type = a.type();
    if (type->kind() == c10::TypeKind::OptionalType) type = type->castRaw<c10::OptionalType>()->getElementType();
    info.dtype_or_layout.push_back(type->kind() == c10::TypeKind::ScalarTypeType ? 1
                                   : type->kind() == c10::TypeKind::LayoutType  ? 2
                                                                                : 0);
  }
  info.batch_norm = schema.name() == "aten::native_batch_norm" || schema.name() == "aten::_native_batch_norm_legit" ||
      schema.name() == "aten::_native_batch_norm_legit_no_training";
  return infos->emplace(&schema, info).first->second;
}

// Quantized, sparse and nested tensors have no mgpu form (the lazy storage holds
// plain strided bytes): refused at the call, by name, as a backend without
// such kernels refuses them.
void refuse_unsupported(const OpInfo& info, const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  const auto& schema = op.schema();
  bool quantized = info.makes_quantized;
  bool sparse = info.makes_sparse;
  bool nested = info.makes_nested;
  for (size_t i = 0; i < args.size(); ++i) {
    const uint8_t kind = i < info.dtype_or_layout.size() ? info.dtype_or_layout[i] : 0;
    if (kind == 1 && args[i].isInt())
      quantized = quantized || c10::isQIntType(static_cast<c10::ScalarType>(args[i].toInt()));
    if (kind == 2 && args[i].isInt())
      sparse = sparse || static_cast<c10::Layout>(args[i].toInt()) != c10::kStrided;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      quantized = quantized || t.is_quantized();
      sparse = sparse || t.layout() != c10::kStrided;
      nested = nested || t.is_nested();
    });
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!quantized, "mgpu: quantized tensors are not supported (", schema.name(),
                              "); quantize on the CPU: x.cpu()");
  TORCH_CHECK_NOT_IMPLEMENTED(!sparse, "mgpu: sparse tensors are not supported (", schema.name(),
                              "); use them on the CPU: x.cpu()");
  TORCH_CHECK_NOT_IMPLEMENTED(!nested, "mgpu: nested tensors are not supported (", schema.name(),
                              "); use them on the CPU: x.cpu(). nn.TransformerEncoder makes them in eval mode "
                              "when given a src_key_padding_mask: build it with enable_nested_tensor=False");
}

} // namespace

// Attention and recurrent ops are tagged as seeded for their dropout: with
// a dropout probability of 0 they draw nothing, and their node needs no
// seed (a seeded node is not background-safe and stays out of tier 1:
// every transformer's scaled_dot_product_attention in eval or without
// attention dropout).
bool draws_nothing(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args) {
  const auto& formals = schema.arguments();
  for (size_t i = 0; i < args.size() && i < formals.size(); ++i) {
    const auto& name = formals[i].name();
    if ((name == "dropout_p" || name == "dropout") && args[i].isDouble()) return args[i].toDouble() == 0.0;
  }
  return false;
}

bool draws_from_default_generator(const OpInfo& info, const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  return info.seeded_default && !draws_nothing(op.schema(), args);
}

void check_same_device(const OpInfo& info, const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  // As on CUDA, indexing takes its indices from the host; a host tensor
  // indexed by mgpu indices is refused with CUDA's error.
  if (info.host_indices) {
    if (!args.empty() && args[0].isTensor() && args[0].toTensor().defined() && !is_mgpu(args[0].toTensor())) {
      bool mgpu_index = false;
      for (size_t i = 1; i < args.size(); ++i) mgpu_index = mgpu_index || holds_mgpu(args[i]);
      TORCH_CHECK(!mgpu_index, "indices should be either on cpu or on the same device as the indexed tensor (",
                  args[0].toTensor().device(), ")");
    }
    return;
  }
  bool any_mgpu = false;
  std::optional<c10::Device> other;
  const auto& schema = op.schema();
  for (size_t i = 0; i < args.size(); ++i) {
    // A PackedSequence keeps its batch sizes on the host, on every device.
    if (info.host_batch_sizes && i == 1) continue;
    // A 0-dim host tensor is a scalar the op reads; one it writes (an out=
    // tensor) is on another device, as on CUDA.
    const bool written = i < schema.arguments().size() && is_mutated(schema.arguments()[i]);
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (is_mgpu(t)) any_mgpu = true;
      else if (t.dim() > 0 || written || !t.device().is_cpu()) other = t.device();
    });
  }
  TORCH_CHECK(!(any_mgpu && other), "Expected all tensors to be on the same device, but found at least two devices, mgpu:0 and ",
              *other, "!");
}

// nansum over `dim=[]` reduces every dim on CPU and CUDA, as sum does; its
// Meta kernel reduces none. The call is recorded as the `dim=None` it means.
// (Other Meta/CPU shape disagreements are caught by the probe of small
// calls, and at run time for large ones, as an error naming the op.)
void canonical_dims(const OpInfo& info, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!info.nansum) return;
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  for (size_t i = 0; i < n; ++i) {
    auto& v = (*stack)[stack->size() - n + i];
    if (schema.arguments()[i].name() == "dim" && v.isIntList() && v.toIntList().empty()) v = c10::IValue();
  }
}

const OpInfo& prepare_call(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const OpInfo& info = op_info(op);
  type_tensor_lists(op.schema(), stack);
  canonical_dims(info, op, stack);
  refuse_unsupported(info, op, torch::jit::last(*stack, op.schema().arguments().size()));
  return info;
}

bool runs_eagerly(const OpInfo& info) { return info.eager; }

bool is_empty_factory(const OpInfo& info) { return info.empty_factory; }

bool is_thread_sensitive(const OpInfo& info) { return info.thread_sensitive; }

bool ignores_matmul_precision(const OpInfo& info) { return info.pointwise || info.empty_factory; }

} // namespace torch_mgpu::capture
