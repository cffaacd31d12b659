#pragma once
// A measured choice between ways of running the same work, the one rule
// of every such choice: tier 1's compiled ways against tier 0
// (engine/tiers.cpp), a plan over other ranks' lanes against one lane
// (engine/plan_cache.cpp), a hot graph's replay against its run without it
// (engine/replays.cpp), a trace's ops run at their call against its lazy
// run (engine/at_call.cpp), and the compile backend's partitions against
// the whole graph (torch_mgpu/compile.py, through _C). Way 0 is the
// baseline, kept unless a challenger's median measures `margin` times
// faster. The ways take turns: the challenger called least (ties: the
// first), or the baseline where it has been called less than that one.
// Each way's first call is cold (plans, caches, compilation) and not timed.
// Bookkeeping only: the caller times, and guards it with its own lock.
#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

namespace torch_mgpu::ir {

// How much faster than the baseline a challenger must measure, by choice.
namespace margin {
constexpr double kCompiled = 1.05;    // tier 1's compiled code against tier 0
constexpr double kPartitions = 1.05;  // the compile backend's partitions against the whole graph
constexpr double kOneLane = 1.0;      // one lane against a plan over other ranks' lanes: the faster
constexpr double kReplay = 1.05;      // a hot graph's replay against its run without it (tier 0 or 1)
constexpr double kAtCall = 1.02;      // a trace's ops run at their call against its lazy run
} // namespace margin

// The median of `v` (the upper one of an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// The rule over medians (index 0 the baseline's; 0 or less: not measured):
// the fastest challenger where its median beats the baseline's by `margin`,
// else 0.
inline size_t choose_by_medians(const std::vector<double>& medians, double margin) {
  size_t best = 0;
  for (size_t j = 1; j < medians.size(); ++j)
    if (medians[j] > 0 && (best == 0 || medians[j] < medians[best])) best = j;
  return best != 0 && medians[best] * margin < medians[0] ? best : 0;
}

class Trial {
 public:
  Trial() = default;
  // `ways` ways (way 0 the baseline), decided on `runs` timed runs each.
  Trial(size_t ways, size_t runs, double margin) : runs_(runs), margin_(margin), cold_(ways, 0), seconds_(ways) {}

  size_t size() const { return cold_.size(); }
  // A challenger more, at the end (`warm`: its first call is timed).
  void add(bool warm = false) {
    cold_.push_back(warm ? 1 : 0);
    seconds_.emplace_back();
  }
  // Way `way` leaves the trial (a challenger that failed); later ones move down.
  void drop(size_t way) {
    cold_.erase(cold_.begin() + static_cast<std::ptrdiff_t>(way));
    seconds_.erase(seconds_.begin() + static_cast<std::ptrdiff_t>(way));
  }
  // Calls of `way` so far: its cold one and its timed ones.
  size_t calls(size_t way) const { return cold_[way] + seconds_[way].size(); }
  // Whose turn it is: among the challengers `allowed(way)` lets run, the
  // one called least (ties: the first); the baseline where it has been
  // called less than that one, or where none may run.
  template <class Allowed>
  size_t turn(Allowed allowed) const {
    size_t pick = 0;
    for (size_t j = 1; j < size(); ++j)
      if (allowed(j) && (pick == 0 || calls(j) < calls(pick))) pick = j;
    return pick != 0 && calls(pick) > calls(0) ? 0 : pick;
  }
  size_t turn() const {
    return turn([](size_t) { return true; });
  }
  // A call of `way`: whether to time it (not its cold first call).
  bool call(size_t way) {
    if (cold_[way] > 0) return true;
    cold_[way] = 1;
    return false;
  }
  // A timed call's seconds (the latest `keep` kept).
  void record(size_t way, double seconds, size_t keep = std::numeric_limits<size_t>::max()) {
    auto& s = seconds_[way];
    s.push_back(seconds);
    if (s.size() > keep) s.erase(s.begin());
  }
  // The baseline's first call was made before the trial (its times come
  // from before it too).
  void baseline_warm() { cold_.at(0) = 1; }
  bool timed(size_t way) const { return seconds_[way].size() >= runs_; }
  bool all_timed() const {
    for (size_t j = 0; j < size(); ++j)
      if (!timed(j)) return false;
    return true;
  }
  double median_of(size_t way) const { return median(seconds_[way]); }
  const std::vector<double>& seconds(size_t way) const { return seconds_[way]; }
  // The choice among the challengers in `over` (the baseline timed): the
  // fastest by median where it beats the baseline's by the margin, else 0.
  size_t choose(const std::vector<size_t>& over) const {
    std::vector<double> medians(size(), 0.0);
    medians[0] = median_of(0);
    for (size_t j : over)
      if (j != 0) medians[j] = median_of(j);
    return choose_by_medians(medians, margin_);
  }
  size_t choose() const {
    std::vector<size_t> all;
    for (size_t j = 1; j < size(); ++j) all.push_back(j);
    return choose(all);
  }
  // The fastest challenger of `over` by median (0 if none).
  size_t fastest(const std::vector<size_t>& over) const {
    size_t best = 0;
    for (size_t j : over)
      if (j != 0 && (best == 0 || median_of(j) < median_of(best))) best = j;
    return best;
  }

 private:
  size_t runs_ = 3;
  double margin_ = 1.0;
  std::vector<size_t> cold_;  // 1 once its cold call is made
  std::vector<std::vector<double>> seconds_;
};

} // namespace torch_mgpu::ir
