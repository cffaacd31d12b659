// Groups of nodes for separately compiled pieces (see groups.h).
#include "plan/groups.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>

namespace torch_mgpu::plan {
namespace {

struct Groups {
  // A group's id is its first node's index when made; a merged group keeps
  // the id of the one it was merged into.
  std::map<int, std::vector<int>> members;
  std::map<int, double> cost;
  std::map<int, std::set<int>> preds, succs;

  bool reaches(int a, int b, bool skip_direct) const {
    std::vector<int> stack;
    for (int s : succs.at(a))
      if (!(skip_direct && s == b)) stack.push_back(s);
    std::set<int> seen(stack.begin(), stack.end());
    while (!stack.empty()) {
      const int g = stack.back();
      stack.pop_back();
      if (g == b) return true;
      for (int s : succs.at(g))
        if (seen.insert(s).second) stack.push_back(s);
    }
    return false;
  }

  bool can_merge(int a, int b) const {
    if (succs.at(a).count(b)) return !reaches(a, b, true);
    if (succs.at(b).count(a)) return !reaches(b, a, true);
    return !reaches(a, b, false) && !reaches(b, a, false);
  }

  void merge(int keep, int gone) {
    auto& m = members[keep];
    m.insert(m.end(), members[gone].begin(), members[gone].end());
    members.erase(gone);
    cost[keep] += cost[gone];
    cost.erase(gone);
    for (int p : preds[gone]) {
      succs[p].erase(gone);
      if (p != keep) {
        succs[p].insert(keep);
        preds[keep].insert(p);
      }
    }
    for (int s : succs[gone]) {
      preds[s].erase(gone);
      if (s != keep) {
        preds[s].insert(keep);
        succs[keep].insert(s);
      }
    }
    preds.erase(gone);
    succs.erase(gone);
    preds[keep].erase(keep);
    succs[keep].erase(keep);
  }

  void contract_chains() {
    bool changed = true;
    while (changed) {
      changed = false;
      std::vector<int> ids;
      for (const auto& [g, _] : members) ids.push_back(g);
      for (int g : ids) {
        if (!members.count(g) || succs[g].size() != 1) continue;
        const int s = *succs[g].begin();
        if (preds[s].size() == 1) {
          merge(g, s);
          changed = true;
        }
      }
    }
  }

  void merge_small(double small, bool siblings) {
    bool changed = true;
    while (changed) {
      changed = false;
      std::vector<int> ids;
      for (const auto& [g, _] : members) ids.push_back(g);
      std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return cost[a] < cost[b]; });
      for (int g : ids) {
        if (!members.count(g) || cost[g] >= small || members.size() == 1) continue;
        // Into its only predecessor (whose other readers wait for it a
        // little longer: it stays in the parallel part), else its only
        // successor (which waits for it anyway, but may be a join: the work
        // moves after the join), else the cheapest successor: never into
        // one of several predecessors, which would then wait for the rest.
        int target = -1;
        // With `siblings`, into a small sibling first (the same predecessors
        // and successors: independent of it), so that many small branches (a
        // feature transform per column) become a few bundles the lanes share
        // instead of all moving into their join.
        if (siblings)
          for (const auto& [h, c] : cost)
            if (h != g && c < small && preds[h] == preds[g] && succs[h] == succs[g] &&
                (target < 0 || c < cost[target]))
              target = h;
        if (target >= 0) {
        } else if (preds[g].size() == 1) {
          target = *preds[g].begin();
        } else if (succs[g].size() == 1) {
          target = *succs[g].begin();
        } else if (preds[g].empty() && succs[g].empty()) {
          // An island (a counter's update): into the cheapest group.
          for (const auto& [k, c] : cost)
            if (k != g && (target < 0 || c < cost[target])) target = k;
        } else {
          std::vector<int> options(succs[g].begin(), succs[g].end());
          std::stable_sort(options.begin(), options.end(), [&](int a, int b) { return cost[a] < cost[b]; });
          for (int o : options)
            if (can_merge(g, o)) {
              target = o;
              break;
            }
        }
        if (target < 0 || !can_merge(g, target)) continue;
        merge(target, g);
        contract_chains();
        changed = true;
        break;
      }
    }
  }

  // Groups in a topological order (ties: by first member).
  std::vector<std::vector<int>> ordered() {
    std::map<int, int> indeg;
    std::map<int, int> first;
    for (auto& [g, m] : members) {
      std::sort(m.begin(), m.end());
      first[g] = m.front();
      indeg[g] = static_cast<int>(preds[g].size());
    }
    auto later = [&](int a, int b) { return first[a] > first[b]; };
    std::vector<int> ready;
    for (const auto& [g, d] : indeg)
      if (d == 0) ready.push_back(g);
    std::vector<std::vector<int>> out;
    while (!ready.empty()) {
      std::sort(ready.begin(), ready.end(), later);
      const int g = ready.back();
      ready.pop_back();
      out.push_back(members[g]);
      for (int s : succs[g])
        if (--indeg[s] == 0) ready.push_back(s);
    }
    TORCH_INTERNAL_ASSERT(out.size() == members.size(), "mgpu: the groups' graph has a cycle");
    return out;
  }
};

} // namespace

std::vector<std::vector<int>> group_nodes(const std::vector<double>& cost, const std::vector<std::vector<int>>& preds,
                                          double small, bool siblings) {
  const int n = static_cast<int>(cost.size());
  TORCH_CHECK(preds.size() == cost.size(), "group_nodes: one list of predecessors per node");
  Groups gs;
  for (int k = 0; k < n; ++k) {
    gs.members[k] = {k};
    gs.cost[k] = cost[static_cast<size_t>(k)];
    gs.preds[k];
    gs.succs[k];
  }
  for (int k = 0; k < n; ++k)
    for (int p : preds[static_cast<size_t>(k)]) {
      TORCH_CHECK(p >= 0 && p < k, "group_nodes: node ", k, " reads node ", p, ", not an earlier one");
      gs.preds[k].insert(p);
      gs.succs[p].insert(k);
    }
  if (n > 1) {
    gs.contract_chains();
    gs.merge_small(small, siblings);
    gs.contract_chains();
  }
  return gs.ordered();
}

} // namespace torch_mgpu::plan
