#pragma once
// Tensor arguments on a boxed stack without references of their own.
//
// The dispatcher reaches a boxed kernel by copying each argument into an
// IValue: a tensor's refcount goes up and back down once per call, and for
// a tensor Python holds (refcount 1 -> 2 -> 1) each step increfs or decrefs
// its Python object, taking the interpreter lock the binding released. A
// kernel that receives `const Tensor&` (its caller's reference outlives the
// call) can put the same tensors on the stack borrowed: no count changes.
//
// Rules for the stack's owner:
//  - code that only reads the arguments (the recording) may run on it as is;
//  - before the stack goes to anything that may consume or replace a
//    tensor argument (another kernel, the eager path), own() gives each
//    borrowed slot a reference of its own;
//  - before the arguments are dropped, release() empties the borrowed
//    slots without touching counts (the destructor does it on any exit,
//    without the checks' exceptions).
// A copy of a borrowed tensor is an ordinary reference (the count goes up
// and down as for any copy); what must never happen is moving the tensor
// out of a borrowed slot.
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace torch_mgpu::capture {

class BorrowedArgs {
 public:
  explicit BorrowedArgs(torch::jit::Stack* stack) : stack_(stack) {}
  BorrowedArgs(const BorrowedArgs&) = delete;
  BorrowedArgs& operator=(const BorrowedArgs&) = delete;
  // On any exit: releases the slots that still hold their tensors (never
  // throws; a slot found written over is a bug slot() reports on the
  // ordinary path, and is left to the stack).
  ~BorrowedArgs() {
    for (const auto& [i, impl] : slots_) {
      if (!holds(i, impl)) continue;
      at::Tensor borrowed = std::move((*stack_)[i]).toTensor();
      c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(borrowed);
    }
  }

  // Pushes one argument: a tensor borrowed, anything else as boxing does.
  template <class T>
  void push(T&& v) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      slots_.emplace_back(static_cast<uint32_t>(stack_->size()), v.unsafeGetTensorImpl());
      stack_->emplace_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(v));
    } else {
      torch::jit::push_one(*stack_, std::forward<T>(v));
    }
  }

  // The borrowed slots take references of their own.
  void own() {
    for (const auto& [i, impl] : slots_) slot(i, impl);  // all checked before any changes hands
    for (const auto& [i, impl] : slots_) {
      c10::IValue& v = slot(i, impl);
      at::Tensor borrowed = std::move(v).toTensor();
      v = c10::IValue(at::Tensor(borrowed));
      c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(borrowed);
    }
    slots_.clear();
  }

  // Whether a borrowed slot holds `impl`'s tensor.
  bool borrows(const c10::TensorImpl* impl) const {
    for (const auto& e : slots_)
      if (e.second == impl) return true;
    return false;
  }

  // Pushes onto the stack, borrowed again, a tensor whose slot release()
  // emptied (an in-place op's result is its argument), checked by the caller
  // with borrows() before the release: released as the others.
  void push_again(c10::TensorImpl* impl) {
    slots_.emplace_back(static_cast<uint32_t>(stack_->size()), impl);
    stack_->emplace_back(at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(impl)));
  }

  // The borrowed slots become None without releasing references.
  void release() {
    for (const auto& [i, impl] : slots_) {
      at::Tensor borrowed = std::move(slot(i, impl)).toTensor();
      c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(borrowed);
    }
    slots_.clear();
  }

 private:
  // A borrowed slot, checked to hold still the tensor it was given: one
  // written over would be released without a reference (a use after free).
  c10::IValue& slot(uint32_t i, const c10::TensorImpl* impl) {
    TORCH_INTERNAL_ASSERT(i < stack_->size(), "mgpu: a borrowed argument was dropped from the stack");
    TORCH_INTERNAL_ASSERT(holds(i, impl), "mgpu: a borrowed argument was replaced on the stack");
    return (*stack_)[i];
  }

  // Whether slot `i` holds still the tensor it was given (the one check,
  // which slot() asserts and the destructor asks without throwing).
  bool holds(uint32_t i, const c10::TensorImpl* impl) const noexcept {
    if (i >= stack_->size()) return false;
    const c10::IValue& v = (*stack_)[i];
    return v.isTensor() && v.unsafeToTensorImpl() == impl;
  }

  torch::jit::Stack* stack_;
  c10::SmallVector<std::pair<uint32_t, const c10::TensorImpl*>, 4> slots_;
};

} // namespace torch_mgpu::capture
