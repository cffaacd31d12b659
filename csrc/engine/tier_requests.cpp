// Tier 1: what a hot graph is (its hashes, the constants that vary
// between its runs), whether it may be compiled, its parts along the lanes,
// and the request the compile thread takes (docs/TIERS.md).
#include "engine/tier1.h"
#include "plan/pieces.h"

namespace torch_mgpu::engine::tier1 {

// A Python number passed where a tensor goes (`x * 2`): a 0-dim CPU tensor.
bool wrapped_number(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().defined() && v.toTensor().dim() == 0 && v.toTensor().device().is_cpu() &&
      v.toTensor().layout() == at::kStrided;
}

// A tensor constant's dtype, sizes and bytes.
uint64_t tensor_value_hash(const at::Tensor& t) {
  const at::Tensor c = t.is_conj() || t.is_neg() ? t.resolve_conj().resolve_neg().contiguous() : t.contiguous();
  uint64_t h = ir::hash_combine(0x7e, static_cast<uint64_t>(c.scalar_type()));
  h = ir::hash_combine(h, t.unsafeGetTensorImpl()->is_wrapped_number() ? 1 : 0);
  for (auto s : c.sizes()) h = ir::hash_combine(h, static_cast<uint64_t>(s));
  const auto* bytes = static_cast<const unsigned char*>(c.const_data_ptr());
  const size_t n = c.nbytes();
  for (size_t i = 0; i < n; i += 8) {
    uint64_t word = 0;
    std::memcpy(&word, bytes + i, std::min<size_t>(8, n - i));
    h = ir::hash_combine(h, word);
  }
  return h;
}

// Constants by value: the structural hash sees floating ones by class only
// (so that plans are shared) and tensor constants (numbers wrapped as 0-dim
// tensors, `x + 3`; CPU tensors passed to an op) by dtype and shape; compiled
// code bakes them in, so their values must match the ones it was compiled
// with.
uint64_t exact_hash(const c10::IValue& v) {
  if (v.isDouble()) {
    const double d = v.toDouble();
    uint64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    return bits;
  }
  if (v.isComplexDouble()) {
    const auto c = v.toComplexDouble();
    return ir::hash_combine(exact_hash(c.real()), exact_hash(c.imag()));
  }
  if (v.isScalar()) {
    const auto s = v.toScalar();
    if (s.isFloatingPoint()) return exact_hash(s.toDouble());
    if (s.isComplex()) return exact_hash(c10::IValue(s.toComplexDouble()));
    if (s.isBoolean()) return ir::hash_combine(0xb0, s.toBool() ? 1 : 0);
    return ir::hash_combine(0x1a, static_cast<uint64_t>(s.toLong()));
  }
  if (v.isList()) {
    uint64_t h = 0x51;
    for (const auto& e : v.toListRef()) h = ir::hash_combine(h, exact_hash(e));
    return h;
  }
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().is_cpu() &&
      v.toTensor().layout() == at::kStrided)
    return tensor_value_hash(v.toTensor());
  if (v.isDoubleList()) {
    uint64_t h = 0x52;
    for (double d : v.toDoubleVector()) h = ir::hash_combine(h, exact_hash(d));
    return h;
  }
  return 0;
}

// Graphs are counted, queued and compiled by structure (the plan cache's
// hash: floating constants by class) and by the lanes they run on: code is
// compiled for its lanes (a part per lane, the lanes' device, stream or
// host lanes), so after configure() changes them for good the graph gets
// hot and compiled there too, and going back finds the code of before.
uint64_t key_of(const ir::Graph& g, const Lanes& l) {
  uint64_t h = ir::hash_combine(g.hash, l.places.size());
  for (size_t i = 0; i < l.places.size(); ++i) {
    h = ir::hash_combine(h, std::hash<std::string>{}(i < l.topo.lanes.size() ? l.topo.lanes[i].name : ""));
    h = ir::hash_combine(h, l.places[i].on_stream() ? 1 : 0);
  }
  return h;
}

bool is_lifted(const std::vector<std::pair<int, int>>& lifted, int node, int arg) {
  return std::find(lifted.begin(), lifted.end(), std::make_pair(node, arg)) != lifted.end();
}

// The exact values of the constants that are not `lifted`: what compiled
// code bakes in.
template <typename Nodes, typename ArgsOf>
uint64_t fixed_hash(const Nodes& nodes, ArgsOf args_of, const std::vector<std::pair<int, int>>& lifted) {
  uint64_t h = 0x7131;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const auto& args = args_of(nodes[i]);
    for (size_t k = 0; k < args.size(); ++k)
      if (args[k].kind == ir::Arg::Kind::Constant && !is_lifted(lifted, static_cast<int>(i), static_cast<int>(k)))
        h = ir::hash_combine(h, exact_hash(args[k].constant));
  }
  return h;
}

uint64_t fixed_hash(const ir::Graph& g, const std::vector<std::pair<int, int>>& lifted) {
  return fixed_hash(g.nodes, [](const ir::NodePtr& n) -> c10::ArrayRef<ir::Arg> { return n->args; }, lifted);
}

uint64_t fixed_hash(const CompileRequest& r, const std::vector<std::pair<int, int>>& lifted) {
  return fixed_hash(r.nodes, [](const CompileRequest::Node& n) -> c10::ArrayRef<ir::Arg> { return n.args; },
                    lifted);
}

// Each constant argument's exact hash, in node and argument order.
std::vector<uint64_t> constant_values(const ir::Graph& g) {
  std::vector<uint64_t> out;
  for (const auto& n : g.nodes)
    for (const auto& a : n->args)
      if (a.kind == ir::Arg::Kind::Constant) out.push_back(exact_hash(a.constant));
  return out;
}

// The constants whose values differ from `first`.
std::vector<std::pair<int, int>> varying_constants(const ir::Graph& g, const std::vector<uint64_t>& first) {
  std::vector<std::pair<int, int>> out;
  size_t at = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const auto& args = g.nodes[i]->args;
    for (size_t k = 0; k < args.size(); ++k) {
      if (args[k].kind != ir::Arg::Kind::Constant) continue;
      if (at >= first.size() || first[at] != exact_hash(args[k].constant))
        out.emplace_back(static_cast<int>(i), static_cast<int>(k));
      ++at;
    }
  }
  return out;
}

// A lifted constant's value as the compiled code takes it.
at::Tensor lifted_input(const c10::IValue& v, c10::Device device) {
  double d = 0;
  if (v.isDouble()) d = v.toDouble();
  else if (v.isScalar()) d = v.toScalar().toDouble();
  else if (v.isTensor()) d = v.toTensor().item().toDouble();
  else TORCH_CHECK(false, "mgpu: a constant compiled as an input is not a number");
  return at::scalar_tensor(d, at::TensorOptions().dtype(at::kDouble).device(device));
}


Numbering number(const ir::Graph& g) {
  Numbering nb;
  std::unordered_map<const ir::Node*, std::vector<int>> seen;  // leaf node -> outputs taken
  for (const auto& n : g.nodes)
    for (const auto& v : n->operands) {
      if (g.find(v.node.get()) >= 0) continue;
      auto& outs = seen[v.node.get()];
      if (std::find(outs.begin(), outs.end(), v.index) != outs.end()) continue;
      outs.push_back(v.index);
      nb.leaves.push_back(v);
    }
  nb.first.resize(g.size() + 1, static_cast<int>(nb.leaves.size()));
  for (size_t i = 0; i < g.size(); ++i) {
    nb.first[i + 1] = nb.first[i] + static_cast<int>(g.nodes[i]->outputs.size());
    for (size_t k = 0; k < g.nodes[i]->outputs.size(); ++k) nb.outputs.emplace_back(static_cast<int>(i), static_cast<int>(k));
  }
  std::unordered_set<int> taken;
  for (const auto& r : g.roots) {
    const int i = g.find(r.node.get());
    if (i < 0) continue;
    const int v = nb.of(r, i);
    if (taken.insert(v).second) {
      nb.roots.push_back(v);
      nb.root_outputs.emplace_back(i, r.index);
    }
  }
  return nb;
}

size_t stored_bytes(const ir::Value& v) {
  const auto& n = *v.node;
  return n.kind == ir::NodeKind::Data ? n.data.nbytes() : n.outputs.at(v.index).nbytes;
}

bool plain_constant(const c10::IValue& v) {
  if (wrapped_number(v) || (v.isTensor() && !v.toTensor().defined())) return true;  // a number; None
  if (v.isGenerator() || v.isTensor() || v.isObject() || v.isCapsule() || v.isFuture()) return false;
  if (v.isCustomClass() || ir::partition_of(v) != nullptr) return false;
  if (v.isList())
    for (const auto& e : v.toListRef())
      if (!plain_constant(e)) return false;
  return true;
}

// add/sub of bool tensors with an alpha other than 1: inductor's CPU code
// for it stores int64 vectors through the bool result's pointer (eight
// bytes per one-byte element: past its buffer, a corrupted heap).
bool bool_sum_with_alpha(const ir::Node& n) {
  const std::string_view name = n.name;
  if (name.rfind("aten::add", 0) != 0 && name.rfind("aten::sub", 0) != 0) return false;
  const auto& schema_args = n.op->schema().arguments();
  bool has_bool = false, alpha_not_one = false;
  for (size_t k = 0; k < n.args.size() && k < schema_args.size(); ++k) {
    const auto& a = n.args[k];
    for (const auto& t : a.tensors)
      has_bool = has_bool || (t && t->geom.dtype == c10::ScalarType::Bool);
    if (schema_args[k].name() == "alpha" && a.kind == ir::Arg::Kind::Constant && a.constant.isScalar())
      alpha_not_one = !(a.constant.toScalar().equal(1));
  }
  return has_bool && alpha_not_one;
}

// An op over integer tensors given a fractional alpha or beta (`addmm(a, b,
// c, beta=0.5)` on int64): eager's kernel casts the scalar to the integer
// type first (0.5 -> 0); inductor's code multiplies by 0.5 and rounds after
// (difffuzz seed 3965240).
bool integer_op_with_fractional_scale(const ir::Node& n) {
  const auto& schema_args = n.op->schema().arguments();
  bool fractional = false, integral = false;
  for (size_t k = 0; k < n.args.size() && k < schema_args.size(); ++k) {
    const auto& a = n.args[k];
    for (const auto& t : a.tensors)
      integral = integral || (t && c10::isIntegralType(t->geom.dtype, /*includeBool=*/false));
    const auto& name = schema_args[k].name();
    if ((name == "alpha" || name == "beta") && a.kind == ir::Arg::Kind::Constant && a.constant.isScalar()) {
      const c10::Scalar s = a.constant.toScalar();
      if (s.isFloatingPoint() && s.toDouble() != static_cast<double>(static_cast<int64_t>(s.toDouble())))
        fractional = true;
    }
  }
  return integral && fractional;
}

// Whether a view may reach one element through two indices (`unfold(0, 2,
// 1)`, an expanded dim): sorted by stride, each dim longer than 1 must step
// past everything the dims before it reach. A write through such a view
// lands in eager's order, element after element; compiled code writes each
// index once from values read before. Exotic layouts that interleave
// without overlap count too: they run in tier 0.
bool may_overlap_itself(const ir::TensorGeometry& g) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims longer than 1
  for (size_t d = 0; d < g.sizes.size(); ++d)
    if (g.sizes[d] > 1) dims.emplace_back(g.strides[d] < 0 ? -g.strides[d] : g.strides[d], g.sizes[d]);
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest offset the dims so far reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return true;
    reach += stride * (size - 1);
  }
  return false;
}

// Why tier 1 may not run `g` on lanes `l` (see tiers.h), or "" when it may.
std::string ineligible(const ir::Graph& g, const Lanes& l) {
  if (g.size() < 2) return "a graph of one op";
  if (l.places.empty()) return "no lanes";
  const c10::Device device = l.places[0].device;
  if (!device.is_cpu() && !device.is_cuda()) return "lanes off the host and CUDA";
  for (const auto& p : l.places) {
    if (p.is_remote()) return "lanes on another rank";
    if (p.device != device) return "lanes on more than one device";
    if (p.on_stream() != l.places[0].on_stream()) return "stream lanes beside host lanes";
  }
  const ir::CallState plain;
  for (const auto& n : g.nodes) {
    // Every tier-1 run checks its graph: the reason is made only when there is one.
    auto no = [&](const char* why) { return std::string(n->name) + ": " + why; };
    if (n->kind != ir::NodeKind::Op || !n->op) return no("not an ATen op");
    if (n->seed) return no("random");
    // An elementwise node carries the pending ops' matmul precision, which
    // it never reads (record_call): left over from products before it.
    ir::CallState settings = n->state;
    if (settings.matmul_precision != plain.matmul_precision && !ir::reads_matmul_precision(*n->op))
      settings.matmul_precision = plain.matmul_precision;
    if (settings != plain) return no("called under non-default settings");
    for (const auto& a : n->args) {
      if (a.kind == ir::Arg::Kind::Constant && !plain_constant(a.constant))
        return no("a constant argument that is not a plain value");
      for (const auto& t : a.tensors) {
        if (t && (t->geom.conj || t->geom.neg)) return no("a conjugate or negative view");
        // Inductor's code for complex tensors has lost an in-place write
        // through a view (a slice's fill_ before the tensor was read
        // transposed) that its FX graph keeps: tier 0 runs them.
        if (t && c10::isComplexType(t->geom.dtype)) return no("complex tensors");
      }
    }
    for (const auto& o : n->outputs)
      if (o.mutated_operand < 0 && c10::isComplexType(o.geom.dtype)) return no("complex tensors");
    if (bool_sum_with_alpha(*n)) return no("a sum of bool tensors with an alpha other than 1");
    if (integer_op_with_fractional_scale(*n)) return no("an integer op with a fractional alpha or beta");
    for (const auto& w : n->written) {
      const auto& a = n->args.at(static_cast<size_t>(w.arg));
      const auto& ref = a.kind == ir::Arg::Kind::Tensor ? a.tensors.at(0) : a.tensors.at(static_cast<size_t>(w.element));
      if (!ref) return no("an out= tensor resized");
      if (may_overlap_itself(ref->geom) || may_overlap_itself(w.after)) return no("a write through a view that overlaps itself");
      // A fresh empty out= tensor the op sizes (`abs`, and the other
      // functional ops whose kernel is empty + out=) replays as the op
      // writing a new tensor; one with bytes before does not.
      if (ref->geom != w.after && stored_bytes(n->operands.at(static_cast<size_t>(ref->operand))) != 0)
        return no("an out= tensor resized");
      // A tensor written while the op reads its storage through another
      // view (`x.copy_(x.select(1, -1))`): the kernel reads what it has
      // already written, in its own order, and eager's result is that
      // order's; compiled code reads everything first.
      for (const auto& other : n->args)
        for (const auto& t : other.tensors)
          if (t && t->operand == ref->operand && t->geom != ref->geom)
            return no("an op that reads the storage it writes through another view");
    }
    for (const auto& v : n->operands) {
      if (g.find(v.node.get()) >= 0) continue;
      const auto kind = v.node->kind;
      if (kind == ir::NodeKind::Data ? !(v.node->data.device().is_cpu() || v.node->data.device() == device)
                                     : kind != ir::NodeKind::Empty)
        return no("reads bytes off the host and the lanes' device");
    }
  }
  return "";
}


std::vector<std::vector<int>> split_for_lanes(const ir::Graph& g, const Lanes& l, std::vector<int>& part_lane,
                                              std::vector<int>& part_of) {
  part_lane.clear();
  const int lanes = static_cast<int>(l.topo.lanes.size());
  if (lanes < 2 || g.size() < 2 || g.deps.size() != g.size()) return {};
  const plan::CostModel cm = cost_model();
  const plan::Estimate est = plan::estimate(g, l.topo, cm);
  std::vector<double> cost(g.size());
  const int threads = l.topo.threads_per_lane(lanes);
  for (size_t i = 0; i < g.size(); ++i) cost[i] = plan::node_seconds(est.work.at(i), cm, threads);
  return plan::split_along_lanes(l.topo, cm, cost, g.deps, part_lane, part_of);
}

// The request for the nodes `nodes` of `g` (ascending): its leaves are the
// values they read that none of them makes, its roots the values they make
// that the sync needs or `needed` marks (read by another part).
CompileRequest request_of(const ir::Graph& g, const Numbering& nb, const std::vector<int>& nodes,
                          const std::vector<char>& needed) {
  CompileRequest req;
  std::unordered_map<int, int> local;  // whole graph's value number -> the request's
  std::unordered_set<int> inside(nodes.begin(), nodes.end());
  for (int i : nodes)
    for (const auto& v : g.nodes[static_cast<size_t>(i)]->operands) {
      const int j = g.find(v.node.get());
      if (j >= 0 && inside.count(j)) continue;
      const int w = nb.of(v, j);
      if (local.emplace(w, static_cast<int>(req.whole_leaves.size())).second) {
        req.whole_leaves.push_back(w);
        req.leaves.push_back(CompileRequest::Leaf{stored_bytes(v)});
      }
    }
  int next = static_cast<int>(req.leaves.size());
  for (int i : nodes) {
    const auto& n = *g.nodes[static_cast<size_t>(i)];
    CompileRequest::Node rn{*n.op, {n.args.begin(), n.args.end()}, {}, {n.outputs.begin(), n.outputs.end()}, {}, n.written};
    for (const auto& v : n.operands) rn.operands.push_back(local.at(nb.of(v, g.find(v.node.get()))));
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      const int w = nb.first[static_cast<size_t>(i)] + static_cast<int>(k);
      local.emplace(w, next);
      rn.output_values.push_back(next++);
      if (needed[static_cast<size_t>(w)]) req.whole_roots.push_back(w);
    }
    req.nodes.push_back(std::move(rn));
    req.whole_nodes.push_back(i);
  }
  for (int w : req.whole_roots) req.roots.push_back(local.at(w));
  return req;
}

// The request for hot graph `g` (`varying`: its constants whose values
// changed between its tier-0 runs), with its parts where it splits over the
// lanes `l` (split_for_lanes).
std::shared_ptr<CompileRequest> request_for(const ir::Graph& g, uint64_t key, const Lanes& l,
                                            std::vector<std::pair<int, int>> varying) {
  const Numbering nb = number(g);
  std::vector<char> needed(static_cast<size_t>(nb.count()), 0);
  for (int v : nb.roots) needed[static_cast<size_t>(v)] = 1;
  std::vector<int> all(g.size());
  for (size_t i = 0; i < g.size(); ++i) all[i] = static_cast<int>(i);
  auto req = std::make_shared<CompileRequest>(request_of(g, nb, all, needed));
  // The whole graph's roots in the sync's order (request_of takes them in
  // node order).
  req->whole_roots = nb.roots;
  req->roots = nb.roots;  // the whole graph numbers its values as nb does
  req->key = key;
  req->varying = std::move(varying);
  req->device = l.places.at(0).device.str();
  req->streams = l.places.at(0).on_stream();
  std::vector<int> lanes, part_of;
  const auto parts = split_for_lanes(g, l, lanes, part_of);
  if (!parts.empty()) {
    for (size_t i = 0; i < g.size(); ++i)
      for (const auto& v : g.nodes[i]->operands) {
        const int j = g.find(v.node.get());
        if (j >= 0 && part_of[static_cast<size_t>(j)] != part_of[i]) needed[static_cast<size_t>(nb.of(v, j))] = 1;
      }
    for (size_t c = 0; c < parts.size(); ++c) {
      req->parts.push_back(request_of(g, nb, parts[c], needed));
      auto& part = req->parts.back();
      part.lane = lanes[c];
      part.key = key;
      part.device = req->device;
      part.streams = req->streams;
      // The varying constants of its nodes, as it numbers them.
      for (const auto& [i, k] : req->varying) {
        const auto at = std::find(part.whole_nodes.begin(), part.whole_nodes.end(), i);
        if (at != part.whole_nodes.end()) part.varying.emplace_back(static_cast<int>(at - part.whole_nodes.begin()), k);
      }
    }
    std::vector<int> distinct = lanes;
    std::sort(distinct.begin(), distinct.end());
    req->lanes = static_cast<int>(std::unique(distinct.begin(), distinct.end()) - distinct.begin());
  }
  return req;
}

} // namespace torch_mgpu::engine::tier1
