#pragma once
// Fault injection, for tests: makes the n-th time execution reaches a point
// throw, as a failing kernel, copy or stream would. Off unless armed (one
// relaxed atomic load per point when off).
//   TORCH_MGPU_FAULT=node:3        the 3rd node run from start-up throws
//   torch_mgpu._C._inject_fault("transfer", 1)   the next transfer throws
// Each arming fires once. Points: "node" (an op, before its kernel writes
// anything; a fused group counts each of its steps), "transfer" (a value
// copied to another device, or a materialized value replicated there),
// "event_wait" (a stream lane waiting for another lane's event),
// "stream_sync" (a stream lane synchronizing its stream at the end of a run).
// Two more points do not throw but leave out one ordering step, for the
// stream sanitizer's tests (runtime/sanitizer.h): "drop_event_wait" (a
// stream lane does not wait for another lane's event) and "drop_record_use"
// (an operand is not recorded on its reader's stream for the allocator).
// "program": a lane of another rank whose program is being built (what:
// "rank1"), as when a node cannot be sent.
#include <cstdint>
#include <string>
#include <string_view>

namespace torch_mgpu::runtime {

enum class FaultPoint : int { Node, Transfer, EventWait, StreamSync, DropEventWait, DropRecordUse, Program, Count };

// Arms `point` to throw at its n-th occurrence from now (n >= 1); n = 0
// disarms it. Where `only` is given, only occurrences at that node or value
// count ("aten::sin.default": the n-th node of that op). Unknown names raise.
void inject_fault(const std::string& point, int64_t n, const std::string& only = "");
// Occurrences of `point` that threw since start-up.
int64_t faults_fired(const std::string& point);
// Throws c10::Error "mgpu: injected fault (<point>[: <what>])" when armed
// and due; `what` names the node or value.
void fault_point(FaultPoint point, std::string_view what = {});
// True when the (dropping) `point` is armed and due: the caller leaves the
// step out.
bool fault_drops(FaultPoint point);

} // namespace torch_mgpu::runtime
