// Tiered execution (see tiers.h): hot graphs, the compile queue, tier-1 runs
// and the measured choice between the tiers.
#include "engine/tiers.h"
#include "ir/env.h"
#include "ir/fork_order.h"

#include "capture/lazy_tensor.h"
#include "capture/state_lock.h"
#include "engine/plan_cache.h"
#include "ir/call_state.h"
#include "ir/held_bytes.h"
#include "ir/partition.h"
#include "runtime/counters.h"
#include "runtime/lanes.h"
#include "runtime/observer.h"
#include "runtime/place.h"

#include <ATen/ThreadLocalState.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <pthread.h>
#include <unordered_map>
#include <unordered_set>

namespace torch_mgpu::engine {
namespace {

constexpr int kTrialRuns = 3;       // timed tier-1 runs (after an untimed first) that decide
constexpr size_t kTier0Runs = 5;    // tier-0 times kept to compare with
// Runs a trial takes at most: a way whose constants compiled in never
// match the graph's (each way lifts its own) gets no times; the trial then
// decides over the ways that have them.
constexpr int kMaxTrialRuns = 24;
constexpr double kMargin = 1.05;    // tier 1 is kept only if this much faster
constexpr size_t kMaxEntries = 256; // graphs remembered; the least recently used goes
// Kept code whose recent runs (the median of this many) take this many
// times its trial's median goes through a second trial, in turns with tier
// 0: the machine may have got busier, or the graph's inputs larger, since
// the code was kept.
constexpr size_t kRecentRuns = 8;
constexpr double kSlowdown = 2.0;

enum class State { Cold, Queued, Trial, Kept, Rejected };

struct Entry {
  int hits = 0;
  State state = State::Cold;
  std::shared_ptr<const CompileRequest> request;  // while queued or compiling
  std::vector<uint64_t> first_values;  // each constant's exact hash at the first tier-0 run
  std::shared_ptr<const CompiledGraph> compiled;  // the code kept
  // On trial: the ways compiled (the whole graph; its parts on the lanes),
  // each's calls (the first is cold) and timed seconds.
  std::vector<std::shared_ptr<const CompiledGraph>> trial;
  std::vector<int> trial_calls;
  std::vector<std::vector<double>> trial_seconds;
  int trial_runs = 0;          // runs since the trial began, in either tier
  std::vector<double> tier0;   // seconds
  std::vector<double> recent;  // kept code's latest runs
  double kept_median = 0;      // its trial's median
  std::string choice;          // what the trial measured: each way compiled, and tier 0
  uint64_t used = 0;
};

struct Tiers {
  std::mutex m;
  std::condition_variable cv;
  std::unordered_map<uint64_t, Entry> entries;
  std::deque<std::shared_ptr<const CompileRequest>> queue;
  int compiling = 0;
  bool stopped = false;
  bool compiler = false;  // a compile thread serves the queue
  std::string last_error;  // why the last graph was dropped from tier 1
  uint64_t clock = 0;
};

Tiers* g_tiers = nullptr;

Tiers& tiers() {
  static const bool made = [] {
    g_tiers = new Tiers();  // leaked: the compile thread may wait on it at exit
    // A forked child has no compile thread: its queue and its graphs start
    // empty, its mutex free. The parent's compiled code is left as it is
    // (not destroyed: that would take the GIL in the child).
    ir::on_fork(ir::ForkRank::Tiers, [] { g_tiers->m.lock(); }, [] { g_tiers->m.unlock(); }, [] {
      new (&g_tiers->m) std::mutex();
      new (&g_tiers->cv) std::condition_variable();
      new (&g_tiers->entries) std::unordered_map<uint64_t, Entry>();
      g_tiers->queue.clear();
      g_tiers->compiling = 0;
      g_tiers->compiler = false;
    });
    return true;
  }();
  (void)made;
  return *g_tiers;
}

// Whether compiled code is on trial (else kept as soon as it is compiled).
std::atomic<bool>& trial_slot() {
  static std::atomic<bool> on{true};
  return on;
}

std::atomic<int>& hits_slot() {
  static std::atomic<int> n{[] {
    const auto e = ir::env::text(ir::env::Var::Compile);
    if (!e || e->empty() || *e == "off") return 0;
    if (e && *e == "on") return 2;
    return static_cast<int>(ir::env::integer(ir::env::Var::Compile, 0, 0));
  }()};
  return n;
}

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
    h = ir::hash_combine(h, l.places[i].streams ? 1 : 0);
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

// The graph's values, numbered as a CompileRequest numbers them: the leaves
// (values read from outside the graph) in first-use order, then every
// node's outputs in node order; and the roots the graph computes, without
// repeats. The same for every graph of one key.
struct Numbering {
  std::vector<ir::Value> leaves;
  std::vector<int> first;                 // first[i]: the number of node i's output 0
  std::vector<std::pair<int, int>> outputs;  // (node, output) of number first[0] + j
  std::vector<int> roots;                 // value numbers
  std::vector<std::pair<int, int>> root_outputs;  // (node, output) of each root

  int count() const { return first.empty() ? 0 : first.back(); }
  // The number of `v`, a leaf or an output of g's node `i` (-1: a leaf).
  int of(const ir::Value& v, int i) const {
    if (i >= 0) return first[static_cast<size_t>(i)] + static_cast<int>(v.index);
    for (size_t k = 0; k < leaves.size(); ++k)
      if (leaves[k] == v) return static_cast<int>(k);
    return -1;
  }
};

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

// Why tier 1 may not run `g` on lanes `l` (see tiers.h), or "" when it may.
std::string ineligible(const ir::Graph& g, const Lanes& l) {
  if (g.size() < 2) return "a graph of one op";
  if (l.places.empty()) return "no lanes";
  const c10::Device device = l.places[0].device;
  if (!device.is_cpu() && !device.is_cuda()) return "lanes off the host and CUDA";
  for (const auto& p : l.places) {
    if (p.remote) return "lanes on another rank";
    if (p.device != device) return "lanes on more than one device";
    if (p.streams != l.places[0].streams) return "stream lanes beside host lanes";
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
    for (const auto& w : n->written) {
      const auto& a = n->args.at(static_cast<size_t>(w.arg));
      const auto& ref = a.kind == ir::Arg::Kind::Tensor ? a.tensors.at(0) : a.tensors.at(static_cast<size_t>(w.element));
      if (!ref) return no("an out= tensor resized");
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

bool eligible(const ir::Graph& g, const Lanes& l) { return ineligible(g, l).empty(); }

// Parts of a split graph beyond this many: compiled whole instead (each
// part is a compile).
constexpr size_t kMaxParts = 16;

// The groups on each lane joined into as few parts as keep the lanes
// apart: a lane's groups, in order, join its current part until one reads
// from a part (on another lane) that the current part does not already
// wait for, or follows a group another lane needs before the rest (below);
// that group starts the lane's next part. A part then waits for
// others only before it starts, and only for parts that do not wait for it
// (counting each lane's order of parts as waits too): lanes that run their
// parts in order cannot wait for each other in a circle. `groups` in a
// topological order; `lane` per group, then per part.
std::vector<std::vector<int>> join_along_lanes(const ir::Graph& g, const std::vector<std::vector<int>>& groups,
                                               std::vector<int>& lane) {
  // A part also ends after a group that another lane reads without reading
  // the later groups of its lane (a trunk and its heads: the head on the
  // other lane waits for the trunk, not for the head after it).
  std::vector<int> group_of(g.size(), -1);
  for (size_t k = 0; k < groups.size(); ++k)
    for (int i : groups[k]) group_of[static_cast<size_t>(i)] = static_cast<int>(k);
  std::vector<std::vector<int>> reads_of(groups.size());  // groups each reads, directly
  for (size_t k = 0; k < groups.size(); ++k)
    for (int i : groups[k])
      for (int d : g.deps[static_cast<size_t>(i)]) {
        const int j = group_of[static_cast<size_t>(d)];
        auto& r = reads_of[k];
        if (j != static_cast<int>(k) && std::find(r.begin(), r.end(), j) == r.end()) r.push_back(j);
      }
  std::vector<char> cut_after(groups.size(), 0);
  for (size_t r = 0; r < groups.size(); ++r)
    for (int k : reads_of[r]) {
      if (lane.at(static_cast<size_t>(k)) == lane.at(r)) continue;
      bool later = false;  // does r read a later group of k's lane?
      for (int j : reads_of[r]) later = later || (j > k && lane.at(static_cast<size_t>(j)) == lane.at(static_cast<size_t>(k)));
      if (!later) cut_after[static_cast<size_t>(k)] = 1;
    }
  std::vector<std::vector<int>> parts, after;  // after[c]: parts c reads (and its lane's previous part)
  std::vector<int> part_lane;
  std::vector<int> part_of(g.size(), -1);
  std::unordered_map<int, int> current;  // lane -> its current part
  std::unordered_map<int, bool> closed;  // lane -> its current part takes no more groups
  std::vector<char> seen;
  auto waits_for = [&](int from, int to) {
    seen.assign(parts.size(), 0);
    std::vector<int> stack{from};
    while (!stack.empty()) {
      const int c = stack.back();
      stack.pop_back();
      if (c == to) return true;
      if (seen[static_cast<size_t>(c)]) continue;
      seen[static_cast<size_t>(c)] = 1;
      for (int d : after[static_cast<size_t>(c)]) stack.push_back(d);
    }
    return false;
  };
  for (size_t k = 0; k < groups.size(); ++k) {
    const int l = lane.at(k);
    auto it = current.find(l);
    int c = it == current.end() ? -1 : it->second;
    std::vector<int> reads;
    for (int i : groups[k])
      for (int d : g.deps[static_cast<size_t>(i)]) {
        const int pd = part_of[static_cast<size_t>(d)];
        if (pd >= 0 && std::find(reads.begin(), reads.end(), pd) == reads.end()) reads.push_back(pd);
      }
    bool fits = c >= 0 && !closed[l];
    for (int pd : reads)
      if (fits && pd != c && !waits_for(c, pd)) fits = false;
    if (!fits) {
      parts.emplace_back();
      after.emplace_back();
      part_lane.push_back(l);
      if (c >= 0) after.back().push_back(c);
      c = static_cast<int>(parts.size()) - 1;
      current[l] = c;
    }
    closed[l] = cut_after[k] != 0;
    auto& a = after[static_cast<size_t>(c)];
    for (int pd : reads)
      if (pd != c && std::find(a.begin(), a.end(), pd) == a.end()) a.push_back(pd);
    for (int i : groups[k]) {
      part_of[static_cast<size_t>(i)] = c;
      parts[static_cast<size_t>(c)].push_back(i);
    }
  }
  for (auto& p : parts) std::sort(p.begin(), p.end());
  lane = std::move(part_lane);
  return parts;
}

// The parts of `g` worth compiling apart and running side by side on the
// lanes: torch.compile's groups (engine.h's schedule_groups, the ops priced
// by the plan's model), each on the lane the list schedule gives it, a
// lane's groups joined into parts (join_along_lanes); `part_of` each node's
// part. Empty where the parts are not predicted to beat one piece (each
// paying a call), or there are more than kMaxParts.
std::vector<std::vector<int>> split_for_lanes(const ir::Graph& g, const Lanes& l, std::vector<int>& part_lane,
                                              std::vector<int>& part_of) {
  part_lane.clear();
  const int lanes = static_cast<int>(l.topo.lanes.size());
  if (lanes < 2 || g.size() < 2 || g.deps.size() != g.size()) return {};
  const plan::CostModel cm = cost_model();
  const plan::Estimate est = plan::estimate(g, l.topo, cm);
  std::vector<double> cost(g.size());
  double total = 0;
  const int threads = l.topo.threads_per_lane(lanes);
  for (size_t i = 0; i < g.size(); ++i) total += cost[i] = plan::node_seconds(est.work.at(i), cm, threads);
  double makespan = 0;
  const auto groups = schedule_groups(cost, g.deps, lanes, part_lane, makespan, /*siblings=*/true);
  if (groups.size() < 2) return {};
  auto parts = join_along_lanes(g, groups, part_lane);
  if (parts.size() < 2 || parts.size() > kMaxParts) return {};
  // The parts' own schedule: each pays one call, and waits for the parts
  // it reads and its lane's previous part.
  PricedPieces priced = price_pieces(parts, cost, g.deps);
  for (size_t c = 0; c < parts.size(); ++c)
    for (size_t d = c; d-- > 0;)
      if (part_lane[d] == part_lane[c]) {
        auto& pp = priced.preds[c];
        if (std::find(pp.begin(), pp.end(), static_cast<int>(d)) == pp.end()) pp.push_back(static_cast<int>(d));
        break;
      }
  if (!worth_splitting(partition_makespan(priced.seconds, priced.preds, lanes), total)) {
    part_lane.clear();
    return {};
  }
  part_of = std::move(priced.piece_of);
  return parts;
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
  req->streams = l.places.at(0).streams;
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

// A leaf's bytes on `device` (a copy there is complete on return: every
// lane's stream may read it).
c10::Storage leaf_bytes(const ir::Value& v, c10::Device device) {
  const auto& n = *v.node;
  if (n.kind == ir::NodeKind::Data && n.data.device() == device) return n.data;
  const size_t nbytes = n.kind == ir::NodeKind::Data ? n.data.nbytes() : n.outputs.at(v.index).nbytes;
  return n.replica_or(device, [&](const c10::Storage* any) {
    if (n.kind == ir::NodeKind::Data) return runtime::copy_to(n.data, device, /*wait=*/true);
    return any ? runtime::copy_to(*any, device, /*wait=*/true) : runtime::allocate(nbytes, device);
  });
}

// One run of a compiled graph: every value's bytes by number, as the parts
// make them.
struct Values {
  const ir::Graph& g;
  const Numbering& nb;
  const std::vector<runtime::Place>& places;  // by lane
  std::vector<c10::Storage> bytes;
  std::mutex m;
  std::unordered_set<const void*> taken;  // storages some value owns
  // Stream lanes: an event after each part, on its lane's stream; a part
  // on another lane waits on it before its own work (set before the part
  // counts as done, read after).
  std::vector<std::optional<c10::Event>> events;

  // Runs part `p` of `c`: reads its leaves' bytes, stores its roots'. On a
  // stream lane (its stream current), the part's work is queued after the
  // events of the parts on other lanes it reads, and an event follows it.
  // No block it reads is freed before every lane's stream has finished (the
  // values between parts live until call() returns, after the lanes'
  // synchronizes), so none needs recording on another stream.
  void run(const CompiledGraph& c, size_t p) {
    const CompiledPart& part = c.parts[p];
    const CompiledGraph::Layout& lay = c.layout[p];
    const runtime::Place& place = places.at(static_cast<size_t>(lay.lane));
    if (place.streams)
      for (int d : lay.after)
        if (c.layout[static_cast<size_t>(d)].lane != lay.lane && events[static_cast<size_t>(d)]) {
          runtime::observers().before_event_wait();
          if (!runtime::observers().drops_event_wait()) events[static_cast<size_t>(d)]->block(place.stream);
        }
    std::vector<at::Tensor> inputs;
    std::unordered_set<const void*> input_bytes;
    for (size_t k = 0; k < lay.leaves.size(); ++k) {
      const int w = lay.leaves[k];
      const c10::Storage& s = bytes.at(static_cast<size_t>(w));
      TORCH_CHECK(static_cast<bool>(s), "mgpu: a compiled part ran before the value it reads");
      // A value made here is read at its own size (its storage may be larger).
      size_t nbytes = s.nbytes();
      if (w >= static_cast<int>(nb.leaves.size())) {
        const auto [i, o] = nb.outputs[static_cast<size_t>(w) - nb.leaves.size()];
        nbytes = g.nodes[static_cast<size_t>(i)]->outputs.at(static_cast<size_t>(o)).nbytes;
      }
      const auto dtype = part.input_dtypes[k];
      const int64_t numel = static_cast<int64_t>(nbytes / c10::elementSize(dtype));
      inputs.push_back(at::empty({0}, at::TensorOptions().dtype(dtype).device(s.device())).set_(s, 0, {numel}, {1}));
      input_bytes.insert(s.data());
    }
    for (const auto& [i, k] : lay.lifted)
      inputs.push_back(lifted_input(g.nodes.at(i)->args.at(k).constant, place.device));
    std::vector<at::Tensor> outs = part.run(inputs);
    std::vector<const void*> written;  // the part's work on its stream writes these
    TORCH_CHECK(outs.size() == lay.roots.size(), "mgpu: a compiled graph returned ", outs.size(),
                " tensors, expected ", lay.roots.size());
    for (size_t j = 0; j < outs.size(); ++j) {
      const int w = lay.roots[j];
      const auto [i, k] = nb.outputs.at(static_cast<size_t>(w) - nb.leaves.size());
      const ir::Output& o = g.nodes[static_cast<size_t>(i)]->outputs.at(static_cast<size_t>(k));
      const at::Tensor& t = outs[j];
      ir::TensorGeometry geom = o.geom;
      if (o.mutated_operand >= 0) {  // the storage's bytes, flat
        geom = ir::TensorGeometry();
        geom.dtype = t.scalar_type();
        geom.sizes = {static_cast<int64_t>(o.nbytes / t.element_size())};
        geom.strides = {1};
      }
      c10::Storage s;
      // A ZeroTensor (inductor returns autograd's `_efficientzerotensor` as
      // one) has no bytes behind its storage: its value is copied (zeros).
      const bool has_bytes = t.defined() && t.layout() == at::kStrided && !t._is_zerotensor() &&
          (t.storage().nbytes() == 0 || t.storage().data() != nullptr);
      if (has_bytes) written.push_back(t.storage().data());
      bool own = has_bytes && t.device() == place.device &&
          capture::geometry_of(t) == geom && t.storage().nbytes() >= o.nbytes && !input_bytes.count(t.storage().data());
      if (own) {
        std::lock_guard<std::mutex> lock(m);
        own = taken.insert(t.storage().data()).second;
      }
      if (own) {
        s = t.storage();
      } else {
        TORCH_CHECK(t.defined() && t.numel() * t.element_size() <= static_cast<int64_t>(o.nbytes),
                    "mgpu: a compiled graph returned a tensor that does not fit its value");
        s = runtime::allocate(o.nbytes, place.device);
        runtime::view(s, geom).copy_(t);
        written.push_back(s.data());
      }
      bytes[static_cast<size_t>(w)] = std::move(s);
    }
    if (!place.streams) return;
    if (runtime::observers().watches_streams()) {
      std::vector<const void*> read(input_bytes.begin(), input_bytes.end());
      runtime::observers().stream_access(place.device,
                                         "compiled part " + std::to_string(p) + " (from node " +
                                             std::to_string(g.nodes.at(static_cast<size_t>(lay.nodes.at(0)))->id) + ")",
                                         read, written, false);
    }
    events[p].emplace(place.device.type());
    events[p]->record(place.stream);
  }
};

// Runs `c` on `g`'s leaves; the roots' bytes in an ExecResult as tier 0
// would leave them. Throws when the compiled code does (nothing written:
// compiled code writes no input). A split graph runs its parts on the
// lanes, each lane its parts in order, each part once the parts it reads
// from are done; `threads`: the intra-op threads of each lane.
runtime::ExecResult call(const ir::Graph& g, const CompiledGraph& c, const std::vector<runtime::Place>& places,
                         int threads) {
  const Numbering nb = number(g);
  TORCH_CHECK(c.layout.size() == c.parts.size() && !c.parts.empty(), "mgpu: a compiled graph without its layout");
  TORCH_CHECK(!places.empty(), "mgpu: a compiled graph without lanes");
  for (const auto& lay : c.layout)
    TORCH_CHECK(lay.lane >= 0 && static_cast<size_t>(lay.lane) < places.size(), "mgpu: a compiled part on a lane the graph does not have");
  const bool streams = places[0].streams;
  Values vals{g, nb, places, std::vector<c10::Storage>(static_cast<size_t>(nb.count())), {}, {}, {}};
  vals.events.resize(c.parts.size());
  for (size_t k = 0; k < nb.leaves.size(); ++k) vals.bytes[k] = leaf_bytes(nb.leaves[k], places[0].device);
  for (const auto& lay : c.layout)
    for (int w : lay.leaves)
      TORCH_CHECK(w >= 0 && w < nb.count(), "mgpu: a compiled graph reads a value the graph does not have");
  runtime::ExecResult r;
  const size_t n = g.size();
  r.values.resize(n);
  r.status.assign(n, runtime::Status::Ok);
  r.timing.assign(n, runtime::NodeTiming{0, 0.0, 0.0, 1});
  r.started = std::chrono::steady_clock::now();
  auto since = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - r.started).count(); };
  std::vector<std::pair<double, double>> spans(c.parts.size());
  if (c.parts.size() == 1 && !streams) {
    vals.run(c, 0);
    spans[0] = {0.0, since()};
  } else {
    // Each lane's parts, in order; done[p]: 1 once part p's roots are stored.
    std::vector<int> slots;
    for (const auto& lay : c.layout)
      if (std::find(slots.begin(), slots.end(), lay.lane) == slots.end()) slots.push_back(lay.lane);
    std::vector<char> done(c.parts.size(), 0);
    bool failed = false;
    std::exception_ptr error;
    std::mutex m;
    std::condition_variable cv;
    at::ThreadLocalState tls;
    std::vector<std::function<void()>> jobs;
    // A lane's failure (the first one is raised): the others stop before
    // their next part.
    const std::function<void(std::exception_ptr)> fail = [&](std::exception_ptr e) {
      std::lock_guard<std::mutex> lock(m);
      if (!error) error = std::move(e);
      failed = true;
      cv.notify_all();
    };
    for (int lane : slots)
      jobs.emplace_back([&, lane] {
        at::ThreadLocalStateGuard guard(tls);
        // A stream lane queues its parts on its stream, then waits for it
        // (whether or not a part failed: nothing it queued may outlive
        // the run).
        const runtime::Place& place = places[static_cast<size_t>(lane)];
        std::optional<c10::StreamGuard> on_stream;
        try {
          if (place.streams) on_stream.emplace(place.stream);
        } catch (...) {  // a device in error: the run fails, nothing was queued
          fail(std::current_exception());
          return;
        }
        struct Drain {
          const runtime::Place& place;
          const std::function<void(std::exception_ptr)>& fail;
          ~Drain() {
            if (!place.streams) return;
            try {
              runtime::observers().before_stream_sync();
              place.stream.synchronize();
              runtime::observers().lane_done();
            } catch (...) {
              fail(std::current_exception());
            }
          }
        } drain{place, fail};
        for (size_t p = 0; p < c.parts.size(); ++p) {
          if (c.layout[p].lane != lane) continue;
          {
            std::unique_lock<std::mutex> lock(m);
            cv.wait(lock, [&] {
              if (failed) return true;
              for (int d : c.layout[p].after)
                if (!done[static_cast<size_t>(d)]) return false;
              return true;
            });
            if (failed) return;
          }
          const double start = since();
          try {
            vals.run(c, p);
          } catch (...) {
            fail(std::current_exception());
            return;
          }
          std::lock_guard<std::mutex> lock(m);
          spans[p] = {start, since()};
          done[p] = 1;
          cv.notify_all();
        }
      });
    {
      // The parts take the interpreter lock to be called: the lanes must
      // not wait for it while this thread holds it.
      capture::InterpreterRelease unlocked;
      runtime::LanePool::instance().run(jobs, threads);
    }
    if (streams && runtime::observers().watches_streams()) {
      // The lanes are joined: the host reads the roots from here on.
      std::vector<std::pair<const void*, std::string>> results;
      for (int w : nb.roots)
        if (vals.bytes.at(static_cast<size_t>(w))) results.emplace_back(vals.bytes[static_cast<size_t>(w)].data(), "a result of a compiled graph");
      runtime::observers().run_done(results);
    }
    if (error) std::rethrow_exception(error);
  }
  const double seconds = since();
  runtime::counters().tier1_call_us += static_cast<int64_t>(seconds * 1e6);
  for (size_t j = 0; j < nb.roots.size(); ++j) {
    const auto [i, k] = nb.root_outputs[j];
    c10::Storage s = vals.bytes.at(static_cast<size_t>(nb.roots[j]));
    TORCH_CHECK(static_cast<bool>(s), "mgpu: a compiled graph did not return a result the sync needs");
    ir::hold(s);
    r.values[static_cast<size_t>(i)].resize(g.nodes[static_cast<size_t>(i)]->outputs.size());
    r.values[static_cast<size_t>(i)][static_cast<size_t>(k)] = std::move(s);
  }
  for (size_t p = 0; p < c.parts.size(); ++p)
    for (int i : c.layout[p].nodes)
      r.timing[static_cast<size_t>(i)] = runtime::NodeTiming{c.layout[p].lane, spans[p].first, spans[p].second, threads};
  r.makespan = seconds;
  return r;
}

// The entry of `key`, made if new (the least recently used one goes when
// there are kMaxEntries). Under t.m: the compiled code of an entry that
// goes is handed to `dropped`, to be let go of after t.m (its deleter takes
// the GIL, and a fork holds the GIL while it takes t.m).
Entry& entry_for(Tiers& t, uint64_t key, std::vector<std::shared_ptr<const CompiledGraph>>& dropped) {
  auto it = t.entries.find(key);
  if (it == t.entries.end()) {
    if (t.entries.size() >= kMaxEntries) {
      auto oldest = t.entries.end();
      for (auto e = t.entries.begin(); e != t.entries.end(); ++e)
        if (e->second.state != State::Queued && (oldest == t.entries.end() || e->second.used < oldest->second.used))
          oldest = e;
      if (oldest != t.entries.end()) {
        if (oldest->second.compiled) dropped.push_back(std::move(oldest->second.compiled));
        for (auto& c : oldest->second.trial) dropped.push_back(std::move(c));
        t.entries.erase(oldest);
      }
    }
    it = t.entries.emplace(key, Entry()).first;
  }
  it->second.used = ++t.clock;
  return it->second;
}

} // namespace

int compile_hits() { return hits_slot().load(); }
void set_compile_trial(bool on) { trial_slot() = on; }
bool compile_trial() { return trial_slot(); }
void set_compile_hits(int hits) {
  TORCH_CHECK(hits >= 0, "compile hits must be >= 0 (0: off), got ", hits);
  hits_slot() = hits;
}

std::shared_ptr<const CompileRequest> next_compile_request() {
  auto& t = tiers();
  std::unique_lock<std::mutex> lock(t.m);
  t.cv.wait(lock, [&] { return t.stopped || !t.queue.empty(); });
  if (t.stopped) return nullptr;
  auto req = t.queue.front();
  t.queue.pop_front();
  t.compiling++;
  return req;
}

namespace {
// Where each compiled part of `req` runs and what it reads and returns, as
// the whole graph numbers them; false when the compiler returned another
// number of parts than the request has.
bool lay_out(const CompileRequest& req, CompiledGraph& c) {
  // The whole graph (one part) or the request's parts.
  const bool whole = c.parts.size() == 1;
  const size_t want = whole ? 1 : req.parts.size();
  if (c.parts.size() != want) return false;
  c.layout.assign(want, {});
  c.lifted.clear();
  std::unordered_map<int, int> made_by;  // value number -> the part returning it
  for (size_t p = 0; p < want; ++p) {
    const CompileRequest& part = whole ? req : req.parts[p];
    auto& lay = c.layout[p];
    lay.lane = part.lane;
    lay.nodes = part.whole_nodes;
    lay.leaves = part.whole_leaves;
    lay.roots = part.whole_roots;
    for (int w : lay.roots) made_by[w] = static_cast<int>(p);
    for (const auto& [i, k] : c.parts[p].lifted) {
      if (i < 0 || static_cast<size_t>(i) >= part.whole_nodes.size()) return false;
      lay.lifted.emplace_back(part.whole_nodes[static_cast<size_t>(i)], k);
      c.lifted.push_back(lay.lifted.back());
    }
    if (c.parts[p].input_dtypes.size() != lay.leaves.size()) return false;
  }
  // The parts each part reads from (earlier ones: join_along_lanes).
  for (auto& lay : c.layout)
    for (int w : lay.leaves) {
      auto it = made_by.find(w);
      if (it != made_by.end() && std::find(lay.after.begin(), lay.after.end(), it->second) == lay.after.end())
        lay.after.push_back(it->second);
    }
  c.lanes = std::max(1, req.lanes);
  c.device = req.device;
  c.streams = req.streams;
  return true;
}
} // namespace

void install_compiled(uint64_t key, std::vector<std::shared_ptr<CompiledGraph>> ways) {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.compiling = std::max(0, t.compiling - 1);
  auto& c = runtime::counters();
  c.tier1_compiled++;
  for (const auto& w : ways) c.tier1_compile_us += static_cast<int64_t>(w->compile_s * 1e6);
  auto it = t.entries.find(key);
  if (it != t.entries.end() && it->second.state == State::Queued && it->second.request) {
    Entry& e = it->second;
    // A way whose parts do not match the request's is dropped (the others
    // may still run).
    std::vector<std::shared_ptr<CompiledGraph>> fit;
    for (auto& w : ways)
      if (lay_out(*e.request, *w)) {
        w->fixed = fixed_hash(*e.request, w->lifted);
        fit.push_back(std::move(w));
      }
    ways = std::move(fit);
    if (ways.empty()) {
      e.state = State::Rejected;
      e.request.reset();
      t.last_error = "not compiled: the compiler returned parts that do not match the graph's";
      c.tier1_rejected++;
      t.cv.notify_all();
      return;
    }
    e.request.reset();
    if (trial_slot()) {
      e.state = State::Trial;
      e.trial_runs = 0;
      e.tier0.clear();  // measured again in turns with the compiled ways
      e.trial.assign(ways.begin(), ways.end());
      e.trial_calls.assign(ways.size(), 0);
      e.trial_seconds.assign(ways.size(), {});
    } else {  // kept as compiled: the last way (the parts, where split)
      e.state = State::Kept;
      e.compiled = ways.back();
    }
  }
  t.cv.notify_all();
}

void reject_compiled(uint64_t key, const std::string& why) {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.compiling = std::max(0, t.compiling - 1);
  runtime::counters().tier1_rejected++;
  auto it = t.entries.find(key);
  if (it != t.entries.end()) {
    it->second.state = State::Rejected;
    it->second.request.reset();
  }
  t.last_error = "not compiled: " + why;
  t.cv.notify_all();
}

void stop_compiles() {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.stopped = true;
  t.compiler = false;
  t.queue.clear();
  t.cv.notify_all();
}

bool wait_for_compiles(double seconds) {
  auto& t = tiers();
  std::unique_lock<std::mutex> lock(t.m);
  return t.cv.wait_for(lock, std::chrono::duration<double>(seconds),
                       [&] { return t.queue.empty() && t.compiling == 0; });
}

std::string last_tier_error() {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  return t.last_error;
}

void set_compiler_present(bool present) {
  auto& t = tiers();
  std::lock_guard<std::mutex> lock(t.m);
  t.compiler = present;
  if (present) t.stopped = false;
}

namespace {
// Whether code compiled for some lanes may run on `l` (the same device and
// kind of lane, and every part's lane there).
bool fits(const CompiledGraph& c, const Lanes& l) {
  if (l.places.empty() || c.device != l.places[0].device.str() || c.streams != l.places[0].streams) return false;
  for (const auto& lay : c.layout)
    if (lay.lane < 0 || static_cast<size_t>(lay.lane) >= l.places.size()) return false;
  return true;
}
} // namespace

std::optional<runtime::ExecResult> run_tier1(const ir::Graph& g, const Lanes& l, int caller_threads, TierRun& run) {
  if (compile_hits() == 0) return std::nullopt;
  run.key = key_of(g, l);
  std::shared_ptr<const CompiledGraph> compiled;
  std::vector<std::shared_ptr<const CompiledGraph>> ways;  // on trial
  std::vector<int> calls;
  int tier0_runs = 0;
  {
    auto& t = tiers();
    std::lock_guard<std::mutex> lock(t.m);
    auto it = t.entries.find(run.key);
    if (it == t.entries.end() || !(it->second.state == State::Trial || it->second.state == State::Kept)) return std::nullopt;
    Entry& e = it->second;
    e.used = ++t.clock;
    if (e.state == State::Kept) {
      compiled = e.compiled;
      run.choice = e.choice;
    } else {
      ways = e.trial;
      calls = e.trial_calls;
      tier0_runs = static_cast<int>(e.tier0.size());
    }
  }
  // The same structure on other lanes: tier 0. On trial, the ways and tier
  // 0 take turns (the machine's load, and tier 0's refined plan, then
  // weigh on all alike): the way called least so far among those whose
  // constants compiled in have this graph's values (each way lifts its
  // own), or tier 0 where it has fewer timed runs than that way (its
  // first call, cold, is not timed).
  if (!eligible(g, l)) return std::nullopt;
  size_t pick = ways.size();
  for (size_t j = 0; j < ways.size(); ++j)
    if (fits(*ways[j], l) && fixed_hash(g, ways[j]->lifted) == ways[j]->fixed &&
        (pick == ways.size() || calls[j] < calls[pick]))
      pick = j;
  if (pick < ways.size() && calls[pick] > tier0_runs + 1) return std::nullopt;  // tier 0's turn
  if (pick < ways.size()) compiled = ways[pick];
  // Other values of the constants compiled in, or other lanes: tier 0.
  if (!compiled || !fits(*compiled, l) || fixed_hash(g, compiled->lifted) != compiled->fixed) return std::nullopt;
  try {
    // The compiled loops have their threads; the kernels they call (a
    // product) take this thread's, as they would on the syncing thread. A
    // split graph's lanes share the cores as tier 0's lanes do.
    runtime::ExecResult r;
    if (compiled->parts.size() == 1) {
      const int threads = std::clamp(caller_threads, 1, l.topo.cores);
      std::optional<runtime::ScopedParallelism> same;
      if (threads != runtime::thread_parallelism()) same.emplace(threads);
      r = call(g, *compiled, l.places, threads);
    } else {
      r = call(g, *compiled, l.places, l.topo.threads_per_lane(compiled->lanes));
    }
    run.compiled = std::move(compiled);
    runtime::counters().tier1_runs++;
    return r;
  } catch (const std::exception& e) {
    run.failed = true;
    // Nothing was written: tier 0 runs the graph and raises what it raises.
    // The compiled code is let go of after the lock (its deleter takes the
    // GIL, and a fork holds the GIL while it takes t.m).
    std::vector<std::shared_ptr<const CompiledGraph>> dropped{std::move(compiled)};
    auto& t = tiers();
    std::lock_guard<std::mutex> lock(t.m);
    t.last_error = std::string("a compiled run failed: ") + e.what();
    runtime::counters().tier1_fallbacks++;
    auto it = t.entries.find(run.key);
    if (it != t.entries.end()) {
      Entry& en = it->second;
      const auto at = std::find(en.trial.begin(), en.trial.end(), dropped.front());
      if (en.state == State::Trial && at != en.trial.end() && en.trial.size() > 1) {
        // On trial beside another way: only this way goes.
        const auto j = static_cast<size_t>(at - en.trial.begin());
        dropped.push_back(std::move(en.trial[j]));
        en.trial.erase(en.trial.begin() + static_cast<std::ptrdiff_t>(j));
        en.trial_calls.erase(en.trial_calls.begin() + static_cast<std::ptrdiff_t>(j));
        en.trial_seconds.erase(en.trial_seconds.begin() + static_cast<std::ptrdiff_t>(j));
      } else {
        en.state = State::Rejected;
        dropped.push_back(std::move(en.compiled));
        for (auto& c : en.trial) dropped.push_back(std::move(c));
        en.trial.clear();
      }
    }
    return std::nullopt;
  }
}

// Ends a trial once every way and tier 0 have their timed runs: the
// fastest way is kept if it beats tier 0, else the graph stays in tier 0.
// A trial that ran kMaxTrialRuns times (its runs in either tier, counted by
// observe_tier) is decided over the ways that were timed.
void finish_trial(Tiers& t, Entry& e, std::vector<std::shared_ptr<const CompiledGraph>>& dropped) {
  const bool out_of_runs = e.trial_runs >= kMaxTrialRuns;
  std::vector<size_t> timed;  // the ways with their timed runs
  for (size_t j = 0; j < e.trial.size(); ++j) {
    if (static_cast<int>(e.trial_seconds[j].size()) >= kTrialRuns) timed.push_back(j);
    else if (!out_of_runs) return;
  }
  const bool tier0_timed = e.tier0.size() >= static_cast<size_t>(kTrialRuns);
  if (!tier0_timed && !out_of_runs) return;
  if (timed.empty() || !tier0_timed) {
    e.state = State::Rejected;
    if (e.compiled) dropped.push_back(std::move(e.compiled));
    t.last_error = "compiled code could not be timed in its trial (constants compiled in that never matched the graph's)";
    runtime::counters().tier1_rejected++;
    for (auto& c : e.trial) dropped.push_back(std::move(c));
    e.trial.clear();
    return;
  }
  // Every way timed (or those that could be): the fastest against tier 0.
  size_t best = timed[0];
  for (size_t j : timed)
    if (median(e.trial_seconds[j]) < median(e.trial_seconds[best])) best = j;
  const double best_s = median(e.trial_seconds[best]);
  const bool faster = best_s * kMargin < median(e.tier0);
  e.state = faster ? State::Kept : State::Rejected;
  e.kept_median = best_s;
  if (faster) {
    e.compiled = e.trial[best];
  } else {
    if (e.compiled) dropped.push_back(std::move(e.compiled));
    t.last_error = "compiled code ran no faster than tier 0 (" + std::to_string(best_s * 1e6) + " us, tier 0 " +
        std::to_string(median(e.tier0) * 1e6) + " us)";
    runtime::counters().tier1_rejected++;
  }
  std::string times;
  for (size_t j : timed)
    times += std::string(e.trial[j]->parts.size() == 1 ? "whole " : "parts ") +
        std::to_string(median(e.trial_seconds[j]) * 1e6) + " us, ";
  e.choice = "measured " + times + "tier 0 " + std::to_string(median(e.tier0) * 1e6) + " us";
  for (auto& c : e.trial) dropped.push_back(std::move(c));
  e.trial.clear();
}

void observe_tier(const ir::Graph& g, const Lanes& l, const TierRun& run, double seconds, bool failed) {
  const int hits = compile_hits();
  if (hits == 0) return;
  auto& t = tiers();
  const uint64_t key = run.key ? run.key : key_of(g, l);
  std::vector<std::shared_ptr<const CompiledGraph>> dropped;  // let go of after the lock
  std::unique_lock<std::mutex> lock(t.m);
  Entry& e = entry_for(t, key, dropped);
  if (run.compiled && e.state == State::Kept) {
    if (!trial_slot()) return;  // kept without trials: kept as it is
    e.recent.push_back(seconds);
    if (e.recent.size() > kRecentRuns) e.recent.erase(e.recent.begin());
    if (e.kept_median == 0 && e.recent.size() == kRecentRuns) {
      e.kept_median = median(e.recent);  // kept before trials were on: its first runs are the measure
      e.recent.clear();
      return;
    }
    const double now = e.recent.size() == kRecentRuns ? median(e.recent) : 0;
    if (now > kSlowdown * e.kept_median) {
      t.last_error = "compiled code slowed down (" + std::to_string(now * 1e6) + " us, " +
          std::to_string(e.kept_median * 1e6) + " us in its trial): a second trial, in turns with tier 0";
      // Tier 0's runs of before are no measure now: the two take turns
      // again, from the compiled code's next (warm, timed) run.
      e.state = State::Trial;
      e.trial_runs = 0;
      e.choice.clear();
      e.trial = {e.compiled};
      e.trial_calls = {1};  // warm: no untimed run
      e.trial_seconds = {{}};
      e.tier0.clear();
      e.recent.clear();
    }
    return;
  }
  if (run.compiled) {
    if (e.state != State::Trial) return;
    const size_t k = static_cast<size_t>(std::find(e.trial.begin(), e.trial.end(), run.compiled) - e.trial.begin());
    if (k == e.trial.size()) return;
    if (e.trial_calls[k]++ != 0) e.trial_seconds[k].push_back(seconds);  // the first call is cold
    ++e.trial_runs;
    finish_trial(t, e, dropped);
    return;
  }
  if (failed || run.failed) return;  // an error is no measure of the graph (nor a failed compiled call's time)
  if (e.state == State::Rejected || e.state == State::Kept) return;
  // The trial compares runs on the lanes its code was compiled for (the
  // key has the lanes: a run on others counts for their own entry; this
  // guards against code that does not fit them all the same).
  if (e.state == State::Trial && !e.trial.empty() && !fits(*e.trial[0], l)) return;
  e.tier0.push_back(seconds);
  if (e.tier0.size() > kTier0Runs) e.tier0.erase(e.tier0.begin());
  if (e.state == State::Trial) {  // tier 0's turn in the trial
    ++e.trial_runs;
    finish_trial(t, e, dropped);
    return;
  }
  if (e.state != State::Cold) return;
  if (++e.hits == 1) {
    lock.unlock();
    std::vector<uint64_t> first = constant_values(g);
    lock.lock();
    entry_for(t, key, dropped).first_values = std::move(first);
    return;
  }
  if (e.hits < hits || !t.compiler) return;
  std::vector<uint64_t> first = e.first_values;
  lock.unlock();
  const std::string why = ineligible(g, l);
  std::shared_ptr<CompileRequest> req = why.empty() ? request_for(g, key, l, varying_constants(g, first)) : nullptr;
  lock.lock();
  Entry& again = entry_for(t, key, dropped);
  if (again.state != State::Cold) return;
  if (!req) {
    again.state = State::Rejected;
    t.last_error = "not compiled: " + why;
    return;
  }
  again.state = State::Queued;
  again.request = req;
  runtime::counters().tier1_hot_graphs++;
  t.queue.push_back(std::move(req));
  t.cv.notify_all();
}

} // namespace torch_mgpu::engine
