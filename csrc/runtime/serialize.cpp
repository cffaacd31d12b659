#include "runtime/serialize.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace torch_mgpu::runtime {

using namespace ir;

void Reader::need(size_t n) const {
  TORCH_CHECK(static_cast<size_t>(end_ - p_) >= n, "torch_mgpu: a remote message ended early (", n,
              " more bytes expected, ", end_ - p_, " left)");
}

namespace {

enum class Tag : uint8_t { None, Bool, Int, Double, Complex, String, Device, List, Tuple, Tensor, Generator, Hole };

// List element types a constant may have.
enum class Elem : uint8_t { Int, Float, Bool, String, Complex, Number, OptInt, OptFloat, Device };

std::optional<Elem> elem_of(const c10::TypePtr& t) {
  switch (t->kind()) {
    case c10::TypeKind::IntType: return Elem::Int;
    case c10::TypeKind::FloatType: return Elem::Float;
    case c10::TypeKind::BoolType: return Elem::Bool;
    case c10::TypeKind::StringType: return Elem::String;
    case c10::TypeKind::ComplexType: return Elem::Complex;
    case c10::TypeKind::NumberType: return Elem::Number;
    case c10::TypeKind::DeviceObjType: return Elem::Device;
    case c10::TypeKind::OptionalType: {
      auto inner = t->castRaw<c10::OptionalType>()->getElementType()->kind();
      if (inner == c10::TypeKind::IntType) return Elem::OptInt;
      if (inner == c10::TypeKind::FloatType) return Elem::OptFloat;
      return std::nullopt;
    }
    default: return std::nullopt;
  }
}

c10::TypePtr type_of(Elem e) {
  switch (e) {
    case Elem::Int: return c10::IntType::get();
    case Elem::Float: return c10::FloatType::get();
    case Elem::Bool: return c10::BoolType::get();
    case Elem::String: return c10::StringType::get();
    case Elem::Complex: return c10::ComplexType::get();
    case Elem::Number: return c10::NumberType::get();
    case Elem::Device: return c10::DeviceObjType::get();
    case Elem::OptInt: return c10::OptionalType::create(c10::IntType::get());
    case Elem::OptFloat: return c10::OptionalType::create(c10::FloatType::get());
  }
  TORCH_CHECK(false, "torch_mgpu: a remote message names an unknown list type");
}

bool plain_tensor(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided && !t.is_quantized() &&
      !t.is_conj() && !t.is_neg();
}

bool value_serializable(const c10::IValue& v) {
  if (v.isNone() || v.isBool() || v.isInt() || v.isDouble() || v.isComplexDouble() || v.isString() ||
      v.isDevice())
    return true;
  if (v.isList()) {
    if (!elem_of(v.toList().elementType())) return false;
    for (const auto& e : v.toList())
      if (!value_serializable(e)) return false;
    return true;
  }
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements())
      if (!value_serializable(e)) return false;
    return true;
  }
  if (v.isTensor()) return plain_tensor(v.toTensor());
  if (v.isGenerator()) return v.toGenerator().device().is_cpu();
  return false;
}

// Whether a constant is part of a program's structure (the plan cache's
// hash sees its value: integers, booleans, strings, devices, lists of
// them) or a value that may change from run to run with the same program
// (floating numbers such as learning rates, tensors, generators).
bool structural(const c10::IValue& v) {
  if (v.isNone() || v.isBool() || v.isInt() || v.isString() || v.isDevice()) return true;
  if (v.isList()) {
    for (const auto& e : v.toList())
      if (!structural(e)) return false;
    return true;
  }
  return false;
}

void write_value(Writer& w, const c10::IValue& v) {
  if (v.isNone()) {
    w.put(Tag::None);
  } else if (v.isBool()) {
    w.put(Tag::Bool);
    w.put<uint8_t>(v.toBool());
  } else if (v.isInt()) {
    w.put(Tag::Int);
    w.put<int64_t>(v.toInt());
  } else if (v.isDouble()) {
    w.put(Tag::Double);
    w.put<double>(v.toDouble());
  } else if (v.isComplexDouble()) {
    w.put(Tag::Complex);
    auto c = v.toComplexDouble();
    w.put<double>(c.real());
    w.put<double>(c.imag());
  } else if (v.isString()) {
    w.put(Tag::String);
    w.put_string(v.toStringRef());
  } else if (v.isDevice()) {
    w.put(Tag::Device);
    w.put<int8_t>(static_cast<int8_t>(v.toDevice().type()));
    w.put<int8_t>(v.toDevice().index());
  } else if (v.isList()) {
    auto l = v.toList();
    w.put(Tag::List);
    w.put(*elem_of(l.elementType()));
    w.put<uint64_t>(l.size());
    for (const auto& e : l) write_value(w, e);
  } else if (v.isTuple()) {
    const auto& el = v.toTupleRef().elements();
    w.put(Tag::Tuple);
    w.put<uint64_t>(el.size());
    for (const auto& e : el) write_value(w, e);
  } else if (v.isTensor()) {
    at::Tensor t = v.toTensor().contiguous();
    w.put(Tag::Tensor);
    w.put<int8_t>(static_cast<int8_t>(t.scalar_type()));
    w.put<uint64_t>(t.dim());
    for (auto s : t.sizes()) w.put<int64_t>(s);
    w.put_bytes(t.data_ptr(), t.nbytes());
  } else if (v.isGenerator()) {
    at::Generator g = v.toGenerator();
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(g.mutex());
      state = g.get_state();
    }
    w.put(Tag::Generator);
    w.put_bytes(state.data_ptr(), state.nbytes());
  } else {
    TORCH_CHECK(false, "torch_mgpu: a constant of type ", v.tagKind(), " cannot be sent to another process");
  }
}

c10::IValue read_value(Reader& r, int depth = 0) {
  TORCH_CHECK(depth < 32, "torch_mgpu: a constant nested too deep");
  switch (r.get<Tag>()) {
    case Tag::None: return c10::IValue();
    case Tag::Bool: return c10::IValue(r.get<uint8_t>() != 0);
    case Tag::Int: return c10::IValue(r.get<int64_t>());
    case Tag::Double: return c10::IValue(r.get<double>());
    case Tag::Complex: {
      double re = r.get<double>();
      double im = r.get<double>();
      return c10::IValue(c10::complex<double>(re, im));
    }
    case Tag::String: return c10::IValue(std::string(r.get_bytes()));
    case Tag::Device: {
      auto type = static_cast<c10::DeviceType>(r.get<int8_t>());
      auto index = r.get<int8_t>();
      return c10::IValue(c10::Device(type, index));
    }
    case Tag::List: {
      c10::impl::GenericList l(type_of(r.get<Elem>()));
      const auto n = r.get<uint64_t>();
      TORCH_CHECK(n <= r.left(), "torch_mgpu: a list of ", n, " constants");
      for (uint64_t k = 0; k < n; ++k) l.push_back(read_value(r, depth + 1));
      return c10::IValue(l);
    }
    case Tag::Tuple: {
      std::vector<c10::IValue> el;
      const auto n = r.get<uint64_t>();
      TORCH_CHECK(n <= r.left(), "torch_mgpu: a tuple of ", n, " constants");
      for (uint64_t k = 0; k < n; ++k) el.push_back(read_value(r, depth + 1));
      return c10::IValue(c10::ivalue::Tuple::create(std::move(el)));
    }
    case Tag::Tensor: {
      const auto code = r.get<int8_t>();
      TORCH_CHECK(code >= 0 && code < static_cast<int8_t>(c10::ScalarType::NumOptions), "torch_mgpu: unknown dtype");
      auto dtype = static_cast<c10::ScalarType>(code);
      const auto dims = r.get<uint64_t>();
      TORCH_CHECK(dims <= 64, "torch_mgpu: a tensor constant of ", dims, " dimensions");
      std::vector<int64_t> sizes(dims);
      for (auto& s : sizes) {
        s = r.get<int64_t>();
        TORCH_CHECK(s >= 0, "torch_mgpu: a tensor constant of negative size");
      }
      auto bytes = r.get_bytes();
      uint64_t want = c10::elementSize(dtype);
      for (auto n : sizes)
        TORCH_CHECK(!__builtin_mul_overflow(want, static_cast<uint64_t>(n), &want),
                    "torch_mgpu: a tensor constant too large");
      TORCH_CHECK(want == bytes.size(), "torch_mgpu: a remote message's tensor has ", bytes.size(), " bytes for ", want);
      at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
      TORCH_CHECK(bytes.size() == t.nbytes(), "torch_mgpu: a remote message's tensor has ", bytes.size(),
                  " bytes for ", t.nbytes());
      if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
      return c10::IValue(t);
    }
    case Tag::Generator: {
      auto bytes = r.get_bytes();
      at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::TensorOptions().dtype(at::kByte));
      if (!bytes.empty()) std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>();
      g.set_state(state);
      return c10::IValue(g);
    }
    case Tag::Hole: break;  // only where read_node expects one
  }
  TORCH_CHECK(false, "torch_mgpu: a remote message holds an unknown constant");
}

} // namespace

void write_geometry(Writer& w, const TensorGeometry& g) {
  w.put<int8_t>(static_cast<int8_t>(g.dtype));
  w.put<uint8_t>(static_cast<uint8_t>(g.sizes.size()));
  for (auto s : g.sizes) w.put<int64_t>(s);
  for (auto s : g.strides) w.put<int64_t>(s);
  w.put<int64_t>(g.offset);
  w.put<uint8_t>(static_cast<uint8_t>(g.conj) | static_cast<uint8_t>(g.neg) << 1);
}

TensorGeometry read_geometry(Reader& r) {
  TensorGeometry g;
  const auto dtype = r.get<int8_t>();
  TORCH_CHECK(dtype >= 0 && dtype < static_cast<int8_t>(c10::ScalarType::NumOptions), "torch_mgpu: unknown dtype ",
              static_cast<int>(dtype));
  g.dtype = static_cast<c10::ScalarType>(dtype);
  const int dims = r.get<uint8_t>();
  g.sizes.resize(dims);
  g.strides.resize(dims);
  for (auto& s : g.sizes) s = r.get<int64_t>();
  for (auto& s : g.strides) s = r.get<int64_t>();
  g.offset = r.get<int64_t>();
  const auto bits = r.get<uint8_t>();
  g.conj = bits & 1;
  g.neg = (bits >> 1) & 1;
  return g;
}

bool serializable(const Node& n) {
  if (n.kind != NodeKind::Op || !n.op) return false;
  for (const auto& a : n.args)
    if (a.kind == Arg::Kind::Constant && !value_serializable(a.constant)) return false;
  return true;
}

void write_node(Writer& w, Writer& values, const Node& n) {
  TORCH_INTERNAL_ASSERT(n.kind == NodeKind::Op && n.op, "torch_mgpu: only op nodes are sent to other processes");
  w.put_string(n.name);
  values.put<uint64_t>(n.id);
  w.put_string(n.where);
  w.put<uint32_t>(static_cast<uint32_t>(n.operands.size()));
  w.put<uint32_t>(static_cast<uint32_t>(n.args.size()));
  for (const auto& a : n.args) {
    w.put(a.kind);
    if (a.kind == Arg::Kind::Constant) {
      if (structural(a.constant)) {
        write_value(w, a.constant);
      } else {
        w.put(Tag::Hole);
        write_value(values, a.constant);
      }
      continue;
    }
    w.put<uint32_t>(static_cast<uint32_t>(a.tensors.size()));
    for (const auto& t : a.tensors) {
      w.put<uint8_t>(t.has_value());
      if (!t) continue;
      w.put<int32_t>(t->operand);
      w.put<int32_t>(t->same);
      write_geometry(w, t->geom);
    }
  }
  w.put<uint32_t>(static_cast<uint32_t>(n.outputs.size()));
  for (const auto& o : n.outputs) {
    w.put<uint64_t>(o.nbytes);
    w.put<int32_t>(o.mutated_operand);
    w.put<int32_t>(o.returned);
    write_geometry(w, o.geom);
  }
  w.put<uint32_t>(static_cast<uint32_t>(n.written.size()));
  for (const auto& x : n.written) {
    w.put<int32_t>(x.arg);
    w.put<int32_t>(x.element);
    write_geometry(w, x.after);
  }
  w.put<uint8_t>(n.seed.has_value());
  if (n.seed) values.put<uint64_t>(*n.seed);
  w.put<int8_t>(static_cast<int8_t>(n.state.default_dtype));
  w.put<uint8_t>(n.state.deterministic);
  w.put<uint8_t>(n.state.deterministic_warn_only);
  w.put<uint8_t>(n.state.fill_uninitialized);
  w.put<int8_t>(n.state.matmul_precision);
  w.put<uint8_t>(n.grad_mode);
  w.put<int16_t>(n.call_threads);
}

NodePtr read_node(Reader& r, std::vector<int>& holes, uint32_t* operand_count) {
  holes.clear();
  auto n = ir::new_node();
  const std::string name(r.get_bytes());
  n->name = intern(name);
  const auto dot = name.find('.');
  const std::string op_name = name.substr(0, dot);
  const std::string overload = dot == std::string::npos ? "" : name.substr(dot + 1);
  auto op = c10::Dispatcher::singleton().findSchema({op_name, overload});
  TORCH_CHECK(op.has_value(), "torch_mgpu: operator ", name, " does not exist in this process");
  n->op = *op;
  n->where = intern(r.get_bytes());
  const auto operands = r.get<uint32_t>();
  if (operand_count) *operand_count = operands;
  const auto args = r.get<uint32_t>();
  TORCH_CHECK(args <= r.left(), "torch_mgpu: a node announces ", args, " arguments");
  for (uint32_t k = 0; k < args; ++k) {
    Arg a;
    a.kind = r.get<Arg::Kind>();
    TORCH_CHECK(static_cast<uint8_t>(a.kind) <= static_cast<uint8_t>(Arg::Kind::OptionalTensorList),
                "torch_mgpu: a remote message holds an unknown argument kind");
    if (a.kind == Arg::Kind::Constant) {
      if (r.peek<Tag>() == Tag::Hole) {
        r.get<Tag>();
        holes.push_back(static_cast<int>(k));  // filled by patch_node
      } else {
        a.constant = read_value(r);
      }
    } else {
      const auto count = r.get<uint32_t>();
      TORCH_CHECK(count <= r.left() && (a.kind != Arg::Kind::Tensor || count == 1),
                  "torch_mgpu: a tensor argument with ", count, " tensors");
      for (uint32_t t = 0; t < count; ++t) {
        if (!r.get<uint8_t>()) {
          a.tensors.emplace_back();
          continue;
        }
        TensorRef ref;
        ref.operand = r.get<int32_t>();
        ref.same = r.get<int32_t>();
        TORCH_CHECK(ref.same >= -1 && ref.same < 1024, "torch_mgpu: a tensor argument names alias ", ref.same);
        ref.geom = read_geometry(r);
        TORCH_CHECK(ref.operand >= 0 && static_cast<uint32_t>(ref.operand) < operands,
                    "torch_mgpu: a remote message's tensor names operand ", ref.operand, " of ", operands);
        a.tensors.emplace_back(std::move(ref));
      }
    }
    n->args.push_back(std::move(a));
  }
  const auto outputs = r.get<uint32_t>();
  TORCH_CHECK(outputs <= r.left(), "torch_mgpu: a node announces ", outputs, " outputs");
  for (uint32_t k = 0; k < outputs; ++k) {
    Output o;
    o.nbytes = r.get<uint64_t>();
    o.mutated_operand = r.get<int32_t>();
    o.returned = r.get<int32_t>();
    o.geom = read_geometry(r);
    TORCH_CHECK(o.mutated_operand < static_cast<int>(operands), "torch_mgpu: a remote message's output names operand ",
                o.mutated_operand, " of ", operands);
    n->outputs.push_back(std::move(o));
  }
  const auto written = r.get<uint32_t>();
  TORCH_CHECK(written <= r.left(), "torch_mgpu: a node announces ", written, " written arguments");
  for (uint32_t k = 0; k < written; ++k) {
    Written x;
    x.arg = r.get<int32_t>();
    x.element = r.get<int32_t>();
    x.after = read_geometry(r);
    TORCH_CHECK(x.arg >= 0 && static_cast<uint32_t>(x.arg) < args, "torch_mgpu: a remote message's written argument ",
                x.arg, " is out of range");
    n->written.push_back(std::move(x));
  }
  if (r.get<uint8_t>()) n->seed = 0;  // its value comes with each run
  n->state.default_dtype = static_cast<c10::ScalarType>(r.get<int8_t>());
  n->state.deterministic = r.get<uint8_t>();
  n->state.deterministic_warn_only = r.get<uint8_t>();
  n->state.fill_uninitialized = r.get<uint8_t>();
  n->state.matmul_precision = r.get<int8_t>();
  n->grad_mode = r.get<uint8_t>();
  n->call_threads = r.get<int16_t>();
  return n;
}

void patch_node(Node& n, const std::vector<int>& holes, Reader& values) {
  n.id = values.get<uint64_t>();
  for (int a : holes) n.args[a].constant = read_value(values);
  if (n.seed) n.seed = values.get<uint64_t>();
}

} // namespace torch_mgpu::runtime
