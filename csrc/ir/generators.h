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

namespace torch_mgpu::ir {

// Whether `op`, which takes no Generator, has an overload that takes one,
// its other arguments and its results the same.
bool has_generator_overload(const c10::OperatorHandle& op);

// Held while a default generator is lent to an op with no such overload
// (native_dropout, the RNNs): seeded for a node and put back (call_seeded),
// or kept and put back around the probe of the call. One such op at a time.
std::mutex& global_generator_mutex();

// Calls that overload on `stack` (holding `op`'s arguments) with `gen`.
// Requires has_generator_overload(op).
void call_with_generator(const c10::OperatorHandle& op, torch::jit::Stack& stack, at::Generator gen);

} // namespace torch_mgpu::ir
