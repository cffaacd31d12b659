#include "plan/fusion.h"
#include "ir/env.h"

#include <c10/util/accumulate.h>

#include <cstdlib>
#include <optional>
#include <string_view>
#include <vector>

namespace torch_mgpu::plan {
namespace {

struct OpSpec {
  PointwiseOp op;
  int arity;        // tensor-or-scalar inputs: args 0 .. arity-1
  bool alpha;       // a third argument that must be 1
};

std::optional<OpSpec> spec_of(std::string_view name) {
  if (name == "aten::add.Tensor" || name == "aten::add.Scalar") return OpSpec{PointwiseOp::Add, 2, true};
  if (name == "aten::sub.Tensor" || name == "aten::sub.Scalar") return OpSpec{PointwiseOp::Sub, 2, true};
  if (name == "aten::mul.Tensor" || name == "aten::mul.Scalar") return OpSpec{PointwiseOp::Mul, 2, false};
  if (name == "aten::div.Tensor" || name == "aten::div.Scalar") return OpSpec{PointwiseOp::Div, 2, false};
  if (name == "aten::neg") return OpSpec{PointwiseOp::Neg, 1, false};
  if (name == "aten::relu") return OpSpec{PointwiseOp::Relu, 1, false};
  return std::nullopt;
}

bool contiguous(const ir::TensorGeometry& g) {
  int64_t expected = 1;
  for (int d = static_cast<int>(g.sizes.size()) - 1; d >= 0; --d) {
    if (g.sizes[d] != 1 && g.strides[d] != expected) return false;
    expected *= g.sizes[d];
  }
  return true;
}

// A host number the op converts to the result's dtype: a Python number
// (wrapped 0-dim tensor), a 0-dim CPU tensor, or a Scalar; real, not bool.
bool real_constant(const c10::IValue& v) {
  if (v.isDouble() || v.isInt()) return true;
  if (!v.isTensor()) return false;
  const auto& t = v.toTensor();
  if (!t.defined() || t.dim() != 0 || !t.device().is_cpu()) return false;
  auto st = t.scalar_type();
  return c10::isFloatingType(st) || c10::isIntegralType(st, /*includeBool=*/false);
}

bool is_one(const c10::IValue& v) {
  return (v.isInt() && v.toInt() == 1) || (v.isDouble() && v.toDouble() == 1.0);
}

// How a tensor argument is read for the output's elements (in the output's
// contiguous order), if the pointwise pass can read it: elementwise, or one
// of the broadcasts of FusedExternal.
std::optional<FusedExternal> read_pattern(const ir::Arg& a, const ir::TensorGeometry& out) {
  if (a.kind != ir::Arg::Kind::Tensor || a.tensors.size() != 1 || !a.tensors[0]) return std::nullopt;
  const auto& geom = a.tensors[0]->geom;
  if (geom.dtype != out.dtype || geom.conj || geom.neg || !contiguous(geom)) return std::nullopt;
  FusedExternal e;
  if (geom.sizes == out.sizes) return e;
  const size_t nd = out.sizes.size();
  if (geom.sizes.size() > nd) return std::nullopt;
  // Broadcasting aligns trailing dims: pad the input's sizes with leading 1s.
  std::vector<int64_t> in(nd - geom.sizes.size(), 1);
  in.insert(in.end(), geom.sizes.begin(), geom.sizes.end());
  if (c10::multiply_integers(geom.sizes) == 1) {
    e.kind = FusedExternal::Kind::Scalar;
    return e;
  }
  // Inner: 1s, then the output's trailing sizes. Outer: the output's leading
  // sizes, then 1s. (Either side may be empty only when the sizes are equal.)
  size_t p = 0;
  while (p < nd && in[p] == 1) ++p;
  bool inner = p > 0;
  for (size_t d = p; d < nd && inner; ++d) inner = in[d] == out.sizes[d];
  if (inner) {
    e.kind = FusedExternal::Kind::Inner;
    e.period = 1;
    for (size_t d = p; d < nd; ++d) e.period *= out.sizes[d];
    return e;
  }
  size_t q = nd;
  while (q > 0 && in[q - 1] == 1) --q;
  bool outer = q < nd;
  for (size_t d = 0; d < q && outer; ++d) outer = in[d] == out.sizes[d];
  if (outer) {
    e.kind = FusedExternal::Kind::Outer;
    e.period = 1;
    for (size_t d = q; d < nd; ++d) e.period *= out.sizes[d];
    return e;
  }
  return std::nullopt;
}

// Whether node n is fusable; fills op and arity, marks constant inputs, and
// says how each tensor input is read (`reads`; the inputs are resolved when
// the node joins a group).
bool fusable(const ir::Node& n, PointwiseStep& s, FusedExternal (&reads)[2]) {
  if (n.kind != ir::NodeKind::Op || n.seed || n.outputs.size() != 1) return false;
  const auto& out = n.outputs[0];
  if (out.mutated_operand >= 0 || out.returned != 0) return false;
  const auto& geom = out.geom;
  if (geom.dtype != c10::ScalarType::Float && geom.dtype != c10::ScalarType::Double) return false;
  if (geom.offset != 0 || geom.conj || geom.neg || !contiguous(geom)) return false;
  auto spec = spec_of(n.name);
  if (!spec) return false;
  const size_t want_args = static_cast<size_t>(spec->arity) + (spec->alpha ? 1 : 0);
  if (n.args.size() != want_args) return false;
  // alpha is fused only when it is 1: a + 1 * b rounds once, whatever the
  // kernel (ATen's vector loop uses a fused multiply-add for alpha).
  if (spec->alpha && (n.args[2].kind != ir::Arg::Kind::Constant || !is_one(n.args[2].constant))) return false;
  s.op = spec->op;
  s.arity = spec->arity;
  int tensors = 0;
  for (int k = 0; k < spec->arity; ++k) {
    const auto& a = n.args[k];
    if (a.kind == ir::Arg::Kind::Constant) {
      if (!real_constant(a.constant)) return false;
      s.in[k] = PointwiseInput{PointwiseInput::Kind::Constant, k};
    } else {
      auto read = read_pattern(a, geom);
      if (!read) return false;
      reads[k] = *read;
      s.in[k] = PointwiseInput{PointwiseInput::Kind::External, k};  // resolved on joining
      ++tensors;
    }
  }
  return tensors > 0;
}

struct Builder {
  const ir::Graph& g;
  Fusion& f;
  std::vector<int> pos;  // per node: step position in the open group, -1 outside
  FusedGroup open;
  int first = -1;        // graph index of the open group's first (and earliest) node

  Builder(const ir::Graph& graph, Fusion& fusion) : g(graph), f(fusion), pos(graph.size(), -1) {}

  void close() {
    for (const auto& s : open.steps) pos[s.node] = -1;
    if (open.steps.size() >= 2) {
      const int id = static_cast<int>(f.groups.size());
      for (const auto& s : open.steps) f.group_of[s.node] = id;
      f.group_at[open.steps[0].node] = id;
      f.groups.push_back(std::move(open));
    }
    open = FusedGroup();
    first = -1;
  }

  // Tries to append node i (fusable, step `s`, inputs read as `reads`) to
  // the open group.
  bool join(int i, PointwiseStep s, const FusedExternal (&reads)[2]) {
    const auto& n = *g.nodes[i];
    const auto& geom = n.outputs[0].geom;
    if (!open.steps.empty() && (geom.dtype != open.dtype || c10::multiply_integers(geom.sizes) != open.numel)) return false;
    // The first node stays the group's earliest in topological order, so
    // "before the first node" means "no descendant of any member".
    if (!open.steps.empty() && i < first) return false;
    std::vector<FusedExternal> ext;
    for (int k = 0; k < s.arity; ++k) {
      if (s.in[k].kind == PointwiseInput::Kind::Constant) continue;
      const auto& ref = *n.args[k].tensors[0];
      const auto& v = n.operands[ref.operand];
      const int d = g.find(v.node.get());
      FusedExternal e = reads[k];
      if (d >= 0 && pos[d] >= 0 && ref.geom.offset == 0 && e.kind == FusedExternal::Kind::Same) {
        s.in[k] = PointwiseInput{PointwiseInput::Kind::Step, pos[d]};
        continue;
      }
      // Read from outside: a graph node must precede the group's start.
      if (d >= 0 && !open.steps.empty() && d >= first) return false;
      s.in[k] = PointwiseInput{PointwiseInput::Kind::External, static_cast<int>(open.externals.size() + ext.size())};
      e.node = i;
      e.arg = k;
      ext.push_back(e);
    }
    if (open.steps.empty()) {
      open.dtype = geom.dtype;
      open.numel = c10::multiply_integers(geom.sizes);
      first = i;
    }
    s.node = i;
    pos[i] = static_cast<int>(open.steps.size());
    open.steps.push_back(s);
    open.externals.insert(open.externals.end(), ext.begin(), ext.end());
    return true;
  }
};

// Which steps are materialized, and scratch slots for the others (a slot
// is free again after its value's last read in the group).
// `root[i]`: node i's result is wanted after the execution.
void assign_slots(const ir::Graph& g, const Fusion& f, const std::vector<char>& root, int id, FusedGroup& grp) {
  const int n = static_cast<int>(grp.steps.size());
  std::vector<int> last_use(n, -1);
  for (int k = 0; k < n; ++k) {
    auto& s = grp.steps[k];
    s.materialize = root[s.node] != 0;
    for (int u : g.users[s.node])
      if (f.group_of[u] != id) s.materialize = true;
    for (int a = 0; a < s.arity; ++a)
      if (s.in[a].kind == PointwiseInput::Kind::Step) last_use[s.in[a].index] = k;
  }
  // ends[k]: the steps whose values step k reads last (a linked list).
  std::vector<int> ends_head(n, -1), ends_next(n, -1);
  for (int j = 0; j < n; ++j)
    if (last_use[j] >= 0) {
      ends_next[j] = ends_head[last_use[j]];
      ends_head[last_use[j]] = j;
    }
  std::vector<int> free_slots, slot_of(n, -1);
  for (int k = 0; k < n; ++k) {
    // Values last read by this step give their slots back first: a step
    // may write the block it reads (elementwise, same index).
    for (int j = ends_head[k]; j >= 0; j = ends_next[j])
      if (slot_of[j] >= 0) {
        free_slots.push_back(slot_of[j]);
        slot_of[j] = -1;
      }
    auto& s = grp.steps[k];
    if (s.materialize) continue;
    if (free_slots.empty()) free_slots.push_back(grp.slots++);
    s.slot = free_slots.back();
    free_slots.pop_back();
    slot_of[k] = s.slot;
    if (last_use[k] < 0) {  // read by nobody (cannot happen in a graph built from roots)
      free_slots.push_back(s.slot);
      slot_of[k] = -1;
    }
  }
}

} // namespace

bool fusion_enabled() {
  static const bool on = ir::env::on_unless_zero(ir::env::Var::Fusion);
  return on;
}

Fusion fuse(const ir::Graph& g, const std::vector<std::vector<int>>& lane_order) {
  Fusion f;
  f.group_at.assign(g.size(), -1);
  f.group_of.assign(g.size(), -1);
  Builder b(g, f);
  for (const auto& order : lane_order) {
    for (int i : order) {
      PointwiseStep s;
      FusedExternal reads[2];
      if (!fusable(*g.nodes[i], s, reads)) {
        b.close();
        continue;
      }
      if (!b.join(i, s, reads)) {
        b.close();
        b.join(i, s, reads);  // a group of its own, always possible
      }
    }
    b.close();
  }
  if (f.groups.empty()) return f;
  std::vector<char> root(g.size(), 0);
  for (const auto& r : g.roots) {
    const int d = g.find(r.node.get());
    if (d >= 0) root[d] = 1;
  }
  for (int id = 0; id < static_cast<int>(f.groups.size()); ++id) assign_slots(g, f, root, id, f.groups[id]);
  return f;
}

} // namespace torch_mgpu::plan
