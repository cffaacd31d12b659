#pragma once
// Events on mgpu: a point in the recorded program (see events.cpp).
#include "engine/execution.h"

#include <cstdint>

namespace torch_mgpu::engine {

class Event {
 public:
  explicit Event(bool timing) : timing_(timing) {}
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Marks every op recorded so far (on any stream).
  void record();
  // Whether they have all run. Never waits for them: if nothing runs them
  // yet, starts them in the background (or, where that is not possible,
  // runs them here), so that polling makes progress.
  bool query();
  // Runs them (with everything else pending) and raises the first error.
  void synchronize();
  // Milliseconds from this event's completion to `end`'s: both recorded,
  // timing, complete.
  double elapsed_ms(Event& end);

 private:
  friend void observe_executed(const ir::Graph& g, const runtime::ExecResult& r);
  bool done();  // under the state lock: complete, running nothing
  bool timing_ = false;
  bool ever_recorded_ = false;
  bool complete_ = true;
  uint64_t horizon_ = 0;  // ops with smaller ids are what it waits for
  double recorded_ = 0;   // steady-clock seconds
  double done_at_ = 0;    // when the last of them ended (at least recorded_)
};

// Whether nothing recorded is left to run (Stream.query()); starts pending
// work as Event::query does.
bool stream_idle();

} // namespace torch_mgpu::engine
