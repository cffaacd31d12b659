// The sync point. Reads as its phases: collect the live pending storages,
// build the graph, look up or build a plan, execute, bind the results back
// to the storages, then report the first error if an op raised.
#include "capture/capture.h"
#include "engine/engine.h"
#include "stats.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <unordered_map>

namespace torch_mgpu {

Counters& counters() {
  static Counters c;
  return c;
}

namespace engine {
namespace {

std::shared_ptr<const PlanRecord>& last_plan_slot() {
  static auto* p = new std::shared_ptr<const PlanRecord>();
  return *p;
}

std::vector<capture::LazyBuffer*> collect() {
  auto bufs = capture::pending_buffers();
  // Creation order, so that the same program builds the same graph (and
  // hash) every time, whatever the registry's iteration order.
  std::sort(bufs.begin(), bufs.end(), [](auto* a, auto* b) {
    if (a->value.node->id != b->value.node->id) return a->value.node->id < b->value.node->id;
    return a->value.index < b->value.index;
  });
  return bufs;
}

// The value a storage ends with when the node making it did not run: an
// in-place write that failed leaves the storage as it was before the op
// (when that earlier version survives); anything else becomes an error.
ir::Value resolve(ir::Value v, const ir::Graph& g, const std::unordered_map<const ir::Node*, int>& index,
                  const runtime::ExecResult& res, const plan::Plan& p) {
  while (true) {
    auto it = index.find(v.node.get());
    if (it == index.end()) return v;  // materialized before this sync
    int i = it->second;
    if (res.status[i] == runtime::Status::Ok) {
      auto s = res.values[i][v.index];
      TORCH_INTERNAL_ASSERT(static_cast<bool>(s), "mgpu: a result was freed before binding");
      return ir::Value{ir::make_data(std::move(s)), 0};
    }
    const auto& out = v.node->outputs[v.index];
    int k = out.mutated_operand;
    if (k >= 0 && !p.reuse[i][k]) {
      v = v.node->operands[k];
      continue;
    }
    std::string why = res.first_message.empty() ? std::string("an earlier op failed") : res.first_message;
    return ir::Value{ir::make_error("this tensor's value was lost when an op failed: " + why, out.nbytes), 0};
  }
}

std::shared_ptr<PlanRecord> describe(const ir::Graph& g, const plan::Plan& p, const runtime::ExecResult& r) {
  auto rec = std::make_shared<PlanRecord>();
  rec->text = ir::to_text(g);
  rec->dot = ir::to_dot(g, p.lane_of);
  for (const auto& n : g.nodes) rec->node_names.push_back(n->name);
  rec->lane_names = p.lane_names;
  rec->timing = r.timing;
  rec->lane_of = p.lane_of;
  rec->policy = p.policy;
  rec->predicted_makespan = p.predicted_makespan;
  rec->measured_makespan = r.makespan;
  rec->graph_hash = g.hash;
  return rec;
}

} // namespace

std::shared_ptr<const PlanRecord> last_plan() {
  std::lock_guard<std::recursive_mutex> lock(capture::state_mutex());
  return last_plan_slot();
}

} // namespace engine

namespace capture {

namespace {
int64_t& max_pending_slot() {
  static int64_t n = [] {
    const char* e = std::getenv("TORCH_MGPU_MAX_PENDING");
    return e ? std::max<int64_t>(1, std::atoll(e)) : int64_t{100000};
  }();
  return n;
}
} // namespace

int64_t max_pending_ops() { return max_pending_slot(); }
void set_max_pending_ops(int64_t n) {
  TORCH_CHECK(n > 0, "max_pending_ops must be positive, got ", n);
  max_pending_slot() = n;
}

void sync_all() {
  using namespace engine;
  std::lock_guard<std::recursive_mutex> lock(state_mutex());
  auto buffers = collect();
  if (buffers.empty()) return;
  std::vector<ir::Value> roots;
  roots.reserve(buffers.size());
  for (auto* b : buffers) roots.push_back(b->value);

  ir::Graph g = ir::build_graph(roots);
  plan::Plan p = plan::make_serial_plan(g);
  counters().plans_built++;
  counters().syncs++;
  runtime::ExecResult r = runtime::execute(g, p);

  std::unordered_map<const ir::Node*, int> index;
  for (size_t i = 0; i < g.size(); ++i) index[g.nodes[i].get()] = static_cast<int>(i);
  for (size_t k = 0; k < buffers.size(); ++k) buffers[k]->value = resolve(roots[k], g, index, r, p);
  last_plan_slot() = describe(g, p, r);
  for (auto& n : g.nodes) ir::mark_executed(*n);
  if (r.first_error) std::rethrow_exception(r.first_error);
}

c10::Storage materialize(const c10::Storage& mgpu_storage) {
  std::lock_guard<std::recursive_mutex> lock(state_mutex());
  auto* b = buffer_of(mgpu_storage);
  if (b->value.node->is_pending()) sync_all();
  const auto& n = *b->value.node;
  switch (n.kind) {
    case ir::NodeKind::Data:
      return n.data;
    case ir::NodeKind::Empty: {
      // First read of an uninitialized storage: give it bytes for good.
      b->value = ir::Value{ir::make_data(runtime::allocate(n.outputs[0].nbytes)), 0};
      return b->value.node->data;
    }
    case ir::NodeKind::Error:
      TORCH_CHECK(false, n.error);
    case ir::NodeKind::Op:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "mgpu: storage still pending after sync");
}

} // namespace capture
} // namespace torch_mgpu
