#pragma once
// A Plan says which lane runs each node and in what order, which values die
// after which node, and which in-place writes may reuse their input's bytes.
#include "ir/graph.h"

#include <string>
#include <vector>

namespace torch_mgpu::plan {

struct Plan {
  std::vector<std::string> lane_names;
  std::vector<int> lane_of;                   // per node
  std::vector<std::vector<int>> lane_order;   // per lane: nodes in run order
  // free_after[i]: (node, output) values whose last reader is node i; a
  // producer index of -1 names an operand outside the graph by position.
  std::vector<std::vector<std::pair<int, int>>> free_after;
  // reuse[i][k]: node i may write operand k in place (it is that value's
  // only reader), instead of writing a copy.
  std::vector<std::vector<bool>> reuse;
  double predicted_makespan = 0.0;
  std::string policy = "serial";
};

// One lane, topological order: the reference every other policy must match.
Plan make_serial_plan(const ir::Graph& g);

// Liveness and in-place reuse for a plan whose lanes and order are set.
void add_liveness(const ir::Graph& g, Plan& plan);

} // namespace torch_mgpu::plan
