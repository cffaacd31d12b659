#pragma once
// What an execution reports as it goes, behind one interface: the points
// where a fault may be injected (faults.h), the stream accesses the
// stream-order sanitizer checks (sanitizer.h) and the counters. The
// executor and run_node call the observers; the concerns live in their
// implementations (observer.cpp), so the scheduling code reads as scheduling.
#include "ir/node.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torch_mgpu::runtime {

class ExecutionObserver {
public:
  virtual ~ExecutionObserver() = default;
  // Before what is named: each may throw (an injected fault), failing it.
  virtual void before_node(const ir::Node& n) {}  // its kernel, or its fused group's step
  virtual void before_transfer() {}               // a copy between devices
  virtual void before_event_wait() {}             // a stream's wait on another lane's event
  virtual void before_stream_sync() {}            // a lane's final synchronize
  // Whether a step of the stream order is to be left out (fault injection
  // of the sanitizer's own tests: a dropped event wait, a dropped record of
  // a block's use on a stream).
  virtual bool drops_event_wait() { return false; }
  virtual bool drops_record_use() { return false; }
  // Whether stream accesses are wanted (each report costs a string).
  virtual bool watches_streams() { return false; }
  // Work queued on `device`'s current stream read `reads` and wrote `writes`
  // (`synchronous`: complete when the call returns). Called for stream
  // lanes only.
  virtual void stream_access(c10::Device device, const std::string& what, const std::vector<const void*>& reads,
                             const std::vector<const void*>& writes, bool synchronous) {}
  virtual void lane_done() {}                  // a stream lane's synchronize returned (on its thread)
  // The run completed (its lanes joined); `results` are the values the host
  // reads from now on, each with its name.
  virtual void run_done(const std::vector<std::pair<const void*, std::string>>& results) {}
  virtual void transferred(size_t bytes) {}   // a copy between devices was made
  virtual void nodes_ran(int64_t count) {}     // nodes that succeeded
  virtual void node_failed() {}                // a node (or its inputs' copy) failed
};

// The observers of every execution, called in order: fault injection, the
// stream-order sanitizer, the counters.
ExecutionObserver& observers();

} // namespace torch_mgpu::runtime
