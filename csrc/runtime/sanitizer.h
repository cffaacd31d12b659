#pragma once
// A stream-order sanitizer for the stream-lane path, run on CPU (the idea
// of PyTorch's CUDA Sanitizer, torch.cuda._sanitizer, applied to our own
// executor with no GPU).
//
// While it runs, the CPU device behaves as a stream device: each thread has
// a current stream, CPU lanes get their own streams (make_places), and
// events, stream waits and synchronizes go to the sanitizer. The executor
// reports every piece of work it queues on a stream lane with the bytes it
// reads and writes (report_stream_access); CPU allocations and frees are
// tracked as the CUDA caching allocator would see them (a block belongs to
// the stream current when it was allocated, recordDataPtrOnStream adds the
// streams it was used on).
//
// Happens-before is tracked with vector clocks: a stream's work is ordered;
// an event carries its stream's clock at record; block joins it into the
// waiting stream; synchronizeStream / synchronizeEvent / a query that
// returns true join it into the calling host thread's clock; work a thread
// queues comes after what that thread knows. What a lane's synchronize
// taught its thread reaches the other threads only when the run completes
// (its lanes are joined), so one lane finishing early never hides another
// lane's missing event; a blocking copy (complete on return, handed to the
// lanes under the executor's lock) is known to all at once. Reported races,
// each naming both accesses:
//   - two accesses to one buffer from different streams, one a write, with
//     no happens-before between them;
//   - a free whose block a stream may still use: an access on a stream that
//     is neither ordered before the free on the block's own stream nor
//     recorded with recordDataPtrOnStream (the caching allocator would hand
//     the block out again while that stream still reads or writes it);
//   - a host read of a buffer a stream may still be writing.
// The kernels themselves run on the host when queued, so results are
// eager's whatever the order; the sanitizer says whether a GPU would agree.
#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace torch_mgpu::runtime {

// True while the sanitizer runs (one relaxed atomic load).
bool stream_sanitizer_on();

// Work queued on the calling thread's current stream of `device` reads
// `reads` and writes `writes` (buffers by their base address). With
// `synchronous`, the host waits for it (a blocking copy). Ignored when off.
void report_stream_access(c10::Device device, std::string_view what, const std::vector<const void*>& reads,
                          const std::vector<const void*>& writes, bool synchronous = false);

// A lane finished (its stream synchronized): what its thread knows becomes
// everyone's when the run completes.
void report_lane_done();
// The run completed: its lanes' threads were joined.
void report_run_done();

// The host reads `buffer` (a result handed to the user).
void report_host_read(const void* buffer, std::string_view what);

// Starts it: installs the CPU streams and the allocator wrapper, forgets
// earlier races. Places made from now on give CPU lanes streams.
void start_stream_sanitizer();
// Stops it (restores CPU's guard and allocator) and returns the races seen.
// Places made while it ran must not run after it stops.
std::vector<std::string> stop_stream_sanitizer();
// Stream accesses checked since the start.
int64_t stream_sanitizer_accesses();
// The races seen since the start or the last call.
std::vector<std::string> take_stream_sanitizer_races();

} // namespace torch_mgpu::runtime
