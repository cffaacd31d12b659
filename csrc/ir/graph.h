#pragma once
// A Graph is the plain-data snapshot of the pending work at a sync point:
// the Op nodes needed by the roots, in topological order, with edges as
// indices. Planning and execution read it; nothing here runs an op.
#include "ir/node.h"
#include "ir/pointer_map.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torch_mgpu::ir {

// Node -> int (its position in a graph).
using NodeIndex = PointerMap<Node, int>;

struct Graph {
  // Pending Op nodes in a topological order (every producer before its users).
  std::vector<NodePtr> nodes;
  // deps[i]: indices of the nodes in `nodes` whose outputs node i reads.
  std::vector<std::vector<int>> deps;
  // users[i]: nodes that read any output of node i.
  std::vector<std::vector<int>> users;
  // The values wanted after execution (the current versions of live storages).
  std::vector<Value> roots;
  // Structural hash of the whole graph: node hashes plus edges plus roots.
  uint64_t hash = 0;
  // Node -> its position in `nodes`.
  NodeIndex index;

  size_t size() const { return nodes.size(); }
  // Position of `n` in `nodes`, -1 when it is not in the graph (a leaf).
  int find(const Node* n) const {
    const int* i = index.get(n);
    return i ? *i : -1;
  }
};

// Post-order walk from the roots through pending nodes; Data nodes are leaves.
Graph build_graph(const std::vector<Value>& roots);

// What printing needs of a graph, cheap to keep after the graph is gone:
// names, edges, and how many operands come from outside (materialized data).
struct GraphSummary {
  std::vector<std::string_view> names;  // interned node names
  // Edges, flat: node i reads nodes dep_list[dep_at[i] .. dep_at[i + 1]).
  std::vector<int> dep_at, dep_list;
  std::vector<int> external;
  std::vector<int> writes;  // outputs that are new versions of an operand
};
GraphSummary summarize(const Graph& g);

// Readable listing, one node a line: `%3 = aten::mm(%1, %2)`.
std::string to_text(const GraphSummary& s);
inline std::string to_text(const Graph& g) { return to_text(summarize(g)); }
// Graphviz; `lane_of` (optional, same length as nodes) colours nodes by lane.
std::string to_dot(const GraphSummary& s, const std::vector<int>& lane_of = {});
inline std::string to_dot(const Graph& g, const std::vector<int>& lane_of = {}) {
  return to_dot(summarize(g), lane_of);
}

} // namespace torch_mgpu::ir
