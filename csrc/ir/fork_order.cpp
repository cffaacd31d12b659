#include "ir/fork_order.h"

#include <pthread.h>

#include <algorithm>
#include <mutex>
#include <new>
#include <vector>

namespace torch_mgpu::ir {
namespace {

struct Entry {
  ForkRank rank;
  ForkHandler prepare, parent, child;
};

struct Handlers {
  std::mutex m;                // guards `entries`
  std::vector<Entry> entries;  // sorted by rank, stable
  // One fork at a time, from the prepare step to after the fork, with the
  // handlers it runs. `m` is not held while the prepare handlers run (the
  // work one waits for may be registering: a singleton made during the
  // cost model's measurement), only after them, through the fork (a
  // registration never waits while holding it). A handler registered
  // between the two is not run by that fork.
  std::mutex forking;
  std::vector<Entry> running;
};

Handlers& handlers() {
  static auto* h = [] {
    auto* made = new Handlers();  // leaked: a fork may come during exit
    pthread_atfork(
        [] {
          Handlers& h = handlers();
          h.forking.lock();
          {
            std::lock_guard<std::mutex> lock(h.m);
            h.running = h.entries;
          }
          for (const Entry& e : h.running)
            if (e.prepare) e.prepare();
          h.m.lock();
        },
        [] {
          Handlers& h = handlers();
          for (auto it = h.running.rbegin(); it != h.running.rend(); ++it)
            if (it->parent) it->parent();
          h.m.unlock();
          h.forking.unlock();
        },
        [] {
          Handlers& h = handlers();
          for (auto it = h.running.rbegin(); it != h.running.rend(); ++it)
            if (it->child) it->child();
          new (&h.m) std::mutex();  // held by this thread: the child's only one
          new (&h.forking) std::mutex();
        });
    return made;
  }();
  return *h;
}

} // namespace

void on_fork(ForkRank rank, ForkHandler prepare, ForkHandler parent, ForkHandler child) {
  Handlers& h = handlers();
  std::lock_guard<std::mutex> lock(h.m);
  auto at = std::upper_bound(h.entries.begin(), h.entries.end(), rank,
                             [](ForkRank r, const Entry& e) { return static_cast<int>(r) < static_cast<int>(e.rank); });
  h.entries.insert(at, Entry{rank, prepare, parent, child});
}

} // namespace torch_mgpu::ir
