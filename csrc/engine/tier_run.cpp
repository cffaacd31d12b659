// Tier 1: a run of compiled code. Each compiled part is a runtime::Part
// (runtime/executor.h) that runtime::execute runs on its lane as it runs a
// node: its waits, events, stream sync, failures and observers are the
// executor's. Here: the plan and the parts of a compiled graph, and the
// call of one part: the bytes it reads as tensors, the tensors it returns
// bound as the graph's values (docs/TIERS.md).
#include "engine/tier1.h"
#include "runtime/executor.h"

namespace torch_mgpu::engine::tier1 {

namespace {

// What the parts of one run share: the storages some value owns (a part's
// returned tensor is kept as a value's bytes at most once).
struct Binding {
  std::mutex m;
  std::unordered_set<const void*> taken;
};

// Part `p` of `c` on `reads` (the bytes of its leaves, by the layout's
// order): the bytes of its roots. A returned tensor whose geometry and
// place fit its value becomes its bytes; any other is copied into fresh
// bytes. `written`: the blocks its work on the lane's stream wrote.
std::vector<c10::Storage> run_part(const ir::Graph& g, const Numbering& nb, const CompiledGraph& c, size_t p,
                                   const std::vector<c10::Storage>& reads, const runtime::Place& place,
                                   Binding& bound, std::vector<const void*>& written) {
  const CompiledPart& part = c.parts[p];
  const CompiledGraph::Layout& lay = c.layout[p];
  std::vector<at::Tensor> inputs;
  std::unordered_set<const void*> input_bytes;
  for (size_t k = 0; k < lay.leaves.size(); ++k) {
    const int w = lay.leaves[k];
    const c10::Storage& s = reads.at(k);
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
  for (const auto& [i, k] : lay.lifted) inputs.push_back(lifted_input(g.nodes.at(i)->args.at(k).constant, place.device));
  std::vector<at::Tensor> outs = part.run(inputs);
  TORCH_CHECK(outs.size() == lay.roots.size(), "mgpu: a compiled graph returned ", outs.size(), " tensors, expected ",
              lay.roots.size());
  std::vector<c10::Storage> made;
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
    // A ZeroTensor (inductor returns autograd's `_efficientzerotensor` as
    // one) has no bytes behind its storage: its value is copied (zeros).
    const bool has_bytes = t.defined() && t.layout() == at::kStrided && !t._is_zerotensor() &&
        (t.storage().nbytes() == 0 || t.storage().data() != nullptr);
    if (has_bytes) written.push_back(t.storage().data());
    bool own = has_bytes && t.device() == place.device && capture::geometry_of(t) == geom &&
        t.storage().nbytes() >= o.nbytes && !input_bytes.count(t.storage().data());
    if (own) {
      std::lock_guard<std::mutex> lock(bound.m);
      own = bound.taken.insert(t.storage().data()).second;
    }
    if (own) {
      made.push_back(t.storage());
      continue;
    }
    TORCH_CHECK(t.defined() && t.numel() * t.element_size() <= static_cast<int64_t>(o.nbytes),
                "mgpu: a compiled graph returned a tensor that does not fit its value");
    c10::Storage s = runtime::allocate(o.nbytes, place.device);
    runtime::view(s, geom).copy_(t);
    written.push_back(s.data());
    made.push_back(std::move(s));
  }
  return made;
}

} // namespace

runtime::ExecResult call(const ir::Graph& g, const CompiledGraph& c, const Lanes& l, int threads) {
  const Numbering nb = number(g);
  const auto& places = l.places;
  TORCH_CHECK(c.layout.size() == c.parts.size() && !c.parts.empty(), "mgpu: a compiled graph without its layout");
  TORCH_CHECK(!places.empty() && l.topo.lanes.size() <= places.size(), "mgpu: a compiled graph without lanes");
  const size_t n = g.size();
  // The plan: each part's nodes on its lane, a lane's parts in order.
  plan::Plan p;
  p.policy = "compiled";
  p.lanes = l.topo.lanes;
  p.lane_of.assign(n, -1);
  p.lane_order.resize(p.lanes.size());
  p.reuse.resize(n);
  p.threads_per_lane = threads;
  runtime::Parts parts;
  parts.part_at.assign(n, -1);
  parts.part_of.assign(n, -1);
  Binding bound;
  for (size_t k = 0; k < c.parts.size(); ++k) {
    const auto& lay = c.layout[k];
    TORCH_CHECK(lay.lane >= 0 && static_cast<size_t>(lay.lane) < p.lanes.size() && !lay.nodes.empty(),
                "mgpu: a compiled part on a lane the graph does not have");
    runtime::Part part;
    part.nodes = lay.nodes;
    for (int i : lay.nodes) {
      TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < n && p.lane_of[i] < 0, "mgpu: a compiled graph's parts do not cover it");
      p.lane_of[i] = lay.lane;
      p.lane_order[lay.lane].push_back(i);
      parts.part_of[i] = static_cast<int>(k);
    }
    parts.part_at[lay.nodes[0]] = static_cast<int>(k);
    for (int w : lay.leaves) {
      TORCH_CHECK(w >= 0 && w < nb.count(), "mgpu: a compiled graph reads a value the graph does not have");
      if (w < static_cast<int>(nb.leaves.size())) {
        part.reads.emplace_back(nb.leaves[w], -1);
      } else {
        const auto [i, o] = nb.outputs[static_cast<size_t>(w) - nb.leaves.size()];
        part.reads.emplace_back(ir::Value{g.nodes[i], o}, i);
      }
    }
    for (int w : lay.roots) part.makes.push_back(nb.outputs.at(static_cast<size_t>(w) - nb.leaves.size()));
    part.name = "compiled part " + std::to_string(k) + " (from node " + std::to_string(g.nodes[lay.nodes[0]]->id) + ")";
    part.call = [&g, &nb, &c, k, &bound](const std::vector<c10::Storage>& reads, const runtime::Place& place,
                                         std::vector<const void*>& written) {
      return run_part(g, nb, c, k, reads, place, bound, written);
    };
    parts.parts.push_back(std::move(part));
  }
  for (size_t i = 0; i < n; ++i) TORCH_CHECK(p.lane_of[i] >= 0, "mgpu: a compiled graph's parts do not cover it");
  p.lanes_used = static_cast<int>(std::count_if(p.lane_order.begin(), p.lane_order.end(),
                                                 [](const std::vector<int>& o) { return !o.empty(); }));
  runtime::ExecResult r;
  {
    // The parts take the interpreter lock to be called: lanes on other
    // threads must not wait for it while this thread holds it.
    std::optional<capture::InterpreterRelease> unlocked;
    if (c.parts.size() > 1 || places[0].on_stream()) unlocked.emplace();
    r = runtime::execute(g, p, places, &parts);
  }
  // Nothing was written (compiled code writes no input): the caller runs
  // the graph in tier 0, which raises what it raises.
  if (r.first_error) std::rethrow_exception(r.first_error);
  runtime::counters().tier1_call_us += static_cast<int64_t>(r.makespan * 1e6);
  return r;
}

} // namespace torch_mgpu::engine::tier1
