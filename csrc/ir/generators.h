#pragma once
// Ops that draw from a device's default generator with no Generator
// argument (rand, randint.low, randperm.out), called so that they draw from
// a generator of their own: their overload that takes one (rand.generator,
// randint.low_generator, randperm.generator_out). A default generator
// borrowed for a call (seeded, then put back) would take or undo the draws
// another thread makes from it meanwhile.
#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <mutex>
#include <optional>

namespace torch_mgpu::ir {

// Whether `op`, which takes no Generator, has an overload that takes one,
// its other arguments and its results the same.
bool has_generator_overload(const c10::OperatorHandle& op);

// Calls `op`, which draws from `device`'s default generator with no
// Generator argument, on `stack` (holding its arguments), moving no
// generator another thread draws from. Where `op` has an overload taking a
// generator, that overload is called with a copy of the default generator;
// else the default generator is lent to the call and its state put back
// after it, under global_generator_mutex (a draw another thread makes from
// it meanwhile is undone). With `seed`, the generator drawn from is seeded
// with it: the numbers are those of the default generator seeded so.
void call_with_own_generator(const c10::OperatorHandle& op, torch::jit::Stack& stack, c10::Device device,
                             std::optional<uint64_t> seed);

// Held while a default generator is lent to an op with no overload taking
// a generator (native_dropout, the RNNs). One such op at a time.
std::mutex& global_generator_mutex();

} // namespace torch_mgpu::ir
