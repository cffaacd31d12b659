#include "ir/graph.h"

#include <algorithm>
#include <sstream>
#include <unordered_map>

namespace torch_mgpu::ir {

Graph build_graph(const std::vector<Value>& roots) {
  Graph g;
  g.roots = roots;
  auto& index = g.index;  // -1 while a node is on the stack
  index.reserve(static_cast<size_t>(std::max<int64_t>(64, pending_op_count())));  // no rehash as it grows
  // Iterative DFS: graphs of 100k nodes in a chain must not overflow the stack.
  struct Frame {
    NodePtr node;
    size_t next;
  };
  std::vector<Frame> stack;
  for (const auto& r : roots) {
    if (!r.node || !r.node->is_pending() || !index.insert(r.node.get(), -1)) continue;
    stack.push_back({r.node, 0});
    while (!stack.empty()) {
      Frame& f = stack.back();
      if (f.next < f.node->operands.size()) {
        const NodePtr& child = f.node->operands[f.next++].node;
        if (child && child->is_pending() && index.insert(child.get(), -1)) stack.push_back({child, 0});
        continue;
      }
      *index.get(f.node.get()) = static_cast<int>(g.nodes.size());
      g.nodes.push_back(std::move(f.node));
      stack.pop_back();
    }
  }
  g.deps.resize(g.nodes.size());
  g.users.resize(g.nodes.size());
  uint64_t h = 0xabcdef;
  // Materialized operands hash by the order in which the graph first reads
  // each: which reads share a value is structure (a plan lets a write reuse
  // a value's bytes only where the writer is its one reader), their
  // identities are not (each run of a loop reads new ones).
  std::unordered_map<const Node*, uint64_t> leaf_order;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = *g.nodes[i];
    h = hash_combine(h, n.hash());
    for (const auto& v : n.operands) {
      const int d = g.find(v.node.get());
      h = hash_combine(h, static_cast<uint64_t>(d + 1));
      h = hash_combine(h, static_cast<uint64_t>(v.index));
      if (d < 0) h = hash_combine(h, leaf_order.emplace(v.node.get(), leaf_order.size()).first->second);
      if (d >= 0) {
        auto& deps = g.deps[i];
        if (std::find(deps.begin(), deps.end(), d) == deps.end()) {
          deps.push_back(d);
          g.users[d].push_back(static_cast<int>(i));
        }
      }
    }
  }
  for (const auto& r : roots) {
    h = hash_combine(h, static_cast<uint64_t>(g.find(r.node.get()) + 1));
    h = hash_combine(h, static_cast<uint64_t>(r.index));
  }
  g.hash = h;
  return g;
}

GraphSummary summarize(const Graph& g) {
  GraphSummary s;
  s.names.reserve(g.size());
  s.dep_at.reserve(g.size() + 1);
  s.dep_at.push_back(0);
  for (const auto& d : g.deps) {
    s.dep_list.insert(s.dep_list.end(), d.begin(), d.end());
    s.dep_at.push_back(static_cast<int>(s.dep_list.size()));
  }
  s.external.assign(g.size(), 0);
  s.writes.assign(g.size(), 0);
  for (size_t i = 0; i < g.size(); ++i) {
    const Node& n = *g.nodes[i];
    s.names.push_back(n.name);
    for (const auto& v : n.operands)
      if (!v.node->is_pending()) s.external[i]++;
    for (const auto& o : n.outputs) s.writes[i] += o.mutated_operand >= 0 ? 1 : 0;
  }
  return s;
}

std::string to_text(const GraphSummary& s) {
  std::ostringstream os;
  for (size_t i = 0; i < s.names.size(); ++i) {
    os << "%" << i << " = " << s.names[i] << "(";
    bool first = true;
    for (int k = s.dep_at[i]; k < s.dep_at[i + 1]; ++k) {
      const int d = s.dep_list[k];
      os << (first ? "" : ", ") << "%" << d;
      first = false;
    }
    if (s.external[i]) os << (first ? "" : ", ") << s.external[i] << " input" << (s.external[i] > 1 ? "s" : "");
    os << ")";
    if (s.writes[i]) os << " in place";
    os << "\n";
  }
  return os.str();
}

std::string to_dot(const GraphSummary& s, const std::vector<int>& lane_of) {
  static const char* colors[] = {"lightblue", "lightpink", "palegreen", "khaki",
                                 "plum", "lightsalmon", "lightcyan", "wheat"};
  std::ostringstream os;
  os << "digraph mgpu {\n  node [shape=box, style=filled];\n";
  for (size_t i = 0; i < s.names.size(); ++i) {
    int lane = i < lane_of.size() ? lane_of[i] : 0;
    os << "  n" << i << " [label=\"%" << i << " " << s.names[i];
    if (!lane_of.empty()) os << "\\nlane " << lane;
    os << "\", fillcolor=" << colors[lane % 8] << "];\n";
  }
  for (size_t i = 0; i < s.names.size(); ++i)
    for (int k = s.dep_at[i]; k < s.dep_at[i + 1]; ++k) os << "  n" << s.dep_list[k] << " -> n" << i << ";\n";
  os << "}\n";
  return os.str();
}

} // namespace torch_mgpu::ir
