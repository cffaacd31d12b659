#include "plan/plan.h"

#include <map>
#include <unordered_map>

namespace torch_mgpu::plan {

Plan make_serial_plan(const ir::Graph& g) {
  Plan p;
  p.lane_names = {"cpu:0/lane0"};
  p.lane_of.assign(g.size(), 0);
  p.lane_order.resize(1);
  for (size_t i = 0; i < g.size(); ++i) p.lane_order[0].push_back(static_cast<int>(i));
  add_liveness(g, p);
  return p;
}

void add_liveness(const ir::Graph& g, Plan& p) {
  // Readers of each value: (node ptr, output index) -> reading nodes.
  std::map<std::pair<const ir::Node*, int>, std::vector<int>> readers;
  for (size_t i = 0; i < g.size(); ++i)
    for (const auto& v : g.nodes[i]->operands)
      readers[{v.node.get(), v.index}].push_back(static_cast<int>(i));
  std::map<std::pair<const ir::Node*, int>, bool> is_root;
  for (const auto& r : g.roots) is_root[{r.node.get(), r.index}] = true;

  std::unordered_map<const ir::Node*, int> index;
  for (size_t i = 0; i < g.size(); ++i) index[g.nodes[i].get()] = static_cast<int>(i);

  // Position of each node in a global order consistent with the lanes: with
  // one lane it is the lane order; with several, the planner's order is kept
  // and "last reader" means last to finish, which the executor tracks with
  // counts instead (see runtime). Here: the last reader in topological order.
  p.free_after.assign(g.size(), {});
  p.reuse.assign(g.size(), {});
  for (size_t i = 0; i < g.size(); ++i) {
    const auto& n = *g.nodes[i];
    p.reuse[i].assign(n.operands.size(), false);
    std::vector<bool> writes(n.operands.size(), false);
    for (const auto& o : n.outputs)
      if (o.mutated_operand >= 0) writes[o.mutated_operand] = true;
    for (size_t k = 0; k < n.operands.size(); ++k) {
      const auto& v = n.operands[k];
      auto key = std::make_pair(static_cast<const ir::Node*>(v.node.get()), v.index);
      const auto& rs = readers[key];
      bool only_reader = rs.size() == 1 && !is_root.count(key);
      p.reuse[i][k] = writes[k] && only_reader;
      auto it = index.find(v.node.get());
      if (it != index.end() && rs.back() == static_cast<int>(i) && !is_root.count(key))
        p.free_after[i].emplace_back(it->second, v.index);
    }
  }
}

} // namespace torch_mgpu::plan
