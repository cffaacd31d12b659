#pragma once
// fork() and the process's locks, in one order.
//
// A lock held by another thread when the program forks stays locked in the
// child, whose only thread can then never take it: each lock the child may
// need is taken by fork()'s prepare step and given back (or made anew) after
// it. pthread_atfork runs prepare handlers in the reverse order of their
// registration, which here is the order in which lazily made singletons
// were first used: a lock could be taken before the work that needs it had
// been waited for (the cost model's measurement allocates through the
// stream sanitizer's allocator, whose lock fork already held: a hang).
// Every handler registers here instead, with its rank: prepare handlers
// run by rank, lowest first (handlers of one rank in their registration
// order), the after-fork handlers in exactly the reverse order.
namespace torch_mgpu::ir {

enum class ForkRank : int {
  WaitForWork = 0,   // work in progress that takes the locks below: the cost model's measurement
  Config = 10,       // the lanes' configuration (held while planning)
  Tiers = 11,        // tier 1's graphs and compile queue
  Registry = 20,     // leaf registries: events, held bytes, node replicas
  Sanitizer = 30,    // the stream sanitizer's state and its allocator (which frees through the host cache)
  HostCache = 31,    // the host cache's blocks
  ChildOnly = 40,    // child-side resets that take no lock in the parent
};

using ForkHandler = void (*)();

// Adds the three handlers (any may be null) at `rank`. Thread-safe; a
// handler must not register another.
void on_fork(ForkRank rank, ForkHandler prepare, ForkHandler parent, ForkHandler child);

} // namespace torch_mgpu::ir
