#pragma once
// Where a lane runs (its kind: LaneKind), and how bytes move between
// places. One executor serves every kind; only the calls here and the
// lane's run function differ between them.
//
// A CPU lane is a host thread: a node's work is done when its call returns,
// so host-side ordering (the executor waits for a node's inputs) is all the
// synchronization there is. A stream lane (CUDA) is a host thread that
// launches onto one stream of one device: work is done when the stream gets
// there. Its nodes run with that stream current (c10::StreamGuard), a value
// read on another lane carries an event (recorded after its producer, waited
// for by the reader's stream), a value read on another stream is recorded on
// that stream for the caching allocator, and the lane synchronizes its
// stream before it reports done. Everything goes through c10's generic
// Stream / Event / DeviceGuardImplInterface, so it compiles in a CPU build.
#include "ir/node.h"
#include "plan/topology.h"

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <memory>
#include <string>
#include <vector>

namespace torch_mgpu::runtime {

class Remote;

// What runs a lane's nodes, and so how they are ordered:
// - Host: a thread of this process; a node is done when its call returns.
// - Stream: a thread of this process launching onto one stream; ordered
//   by the stream (events across lanes), done when the stream gets there.
// - Remote: another rank runs the lane's nodes as a program (remote.h).
// The executor runs each kind by its own function (run_lanes.cpp:
// run_host_lane, run_stream_lane; remote_lanes.cpp for remote lanes).
enum class LaneKind { Host, Stream, Remote };

struct Place {
  LaneKind kind = LaneKind::Host;
  c10::Device device{c10::kCPU};
  c10::Stream stream{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};  // a Stream lane's
  // A Remote lane's rank (runtime/remote.h): its nodes run there, on
  // `there` (that rank's CPU or one of its CUDA devices); `device` is the
  // host, where its values land when read here.
  std::shared_ptr<Remote> remote;
  c10::Device there{c10::kCPU};

  bool on_stream() const { return kind == LaneKind::Stream; }
  bool is_remote() const { return kind == LaneKind::Remote; }
};

// "cpu" and "cpu:N" (virtual CPU devices are all the host) or "cuda:N";
// "rankN:cpu" and "rankN:cuda:K" (another process's devices) are the host
// here.
c10::Device physical_device(const std::string& name);
// The device "rankN:cpu" or "rankN:cuda:K" names on rank N.
c10::Device device_on_rank(const std::string& name);
// Visible CUDA devices: 0 in a CPU build or on a machine with no GPU.
int cuda_device_count();
// Sets CUDA up in this process (its caching allocator and generators), as
// torch.cuda's lazy init does at a Python program's first CUDA tensor: a
// process that never made one itself (a worker rank, a C++ program) calls
// this before its lanes allocate on a GPU. Cheap after the first call.
void init_cuda();
// One place per lane: a CUDA lane takes its own stream from the device's pool.
std::vector<Place> make_places(const plan::Topology& t);

// A tensor over `storage` with `geom`, on the storage's device.
at::Tensor view(const c10::Storage& storage, const ir::TensorGeometry& geom);
// The first `nbytes` bytes of `storage` as a flat tensor of bytes, on its
// device.
at::Tensor byte_view(const c10::Storage& storage, size_t nbytes);
// A storage of `nbytes` whose bytes are nowhere yet (on the meta device):
// a value kept on another rank, an allocation not made yet.
c10::Storage placeholder(size_t nbytes);
// Fresh bytes on `device` (device memory is ordered on its current stream).
c10::Storage allocate(size_t nbytes, c10::Device device = c10::Device(c10::kCPU));
// Zeroes every byte of `s`.
void zero(const c10::Storage& s);
// A copy of `src` on `device`. Host to host is a memcpy; a copy that lands on
// the host, or any copy with `wait`, is complete on return; any other copy
// is queued on the current streams.
c10::Storage copy_to(const c10::Storage& src, c10::Device device, bool wait = false);
// Tells the caching allocator that `s` is in use on `stream` (a value read on
// a stream other than the one it was made on), through the device's guard
// implementation (a no-op for host memory).
void record_use(const c10::Storage& s, const c10::Stream& stream);

} // namespace torch_mgpu::runtime
