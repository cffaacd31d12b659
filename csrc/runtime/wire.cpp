// The wire between the controller and its workers: framing, sends and
// receives over c10d, errors that cross (wire.h), the program message's
// bytes, and the versions both sides check.
#include "runtime/wire.h"
#include "ir/env.h"
#include "ir/errors.h"
#include "ir/call_state.h"
#include "runtime/counters.h"
#include "runtime/place.h"
#include "runtime/run_node.h"
#include "runtime/serialize.h"
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <ATen/Parallel.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include <torch/version.h>

#include <algorithm>
#include <cstdlib>

namespace torch_mgpu::runtime {
namespace wire {

std::chrono::milliseconds timeout() {
  static const auto t = [] {
    const double seconds = ir::env::positive_number(ir::env::Var::RemoteTimeout).value_or(3600.0);
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }();
  return t;
}

std::chrono::milliseconds forever() { return std::chrono::milliseconds(std::numeric_limits<int32_t>::max()); }

at::Tensor bytes_of(const c10::Storage& s) {
  return at::from_blob(s.mutable_data(), {static_cast<int64_t>(s.nbytes())}, at::TensorOptions().dtype(at::kByte));
}

void send_message(c10d::Backend& b, int peer, int tag, Msg kind, const std::string& body,
                  const std::vector<c10::Storage>& blobs, Pending* pending) {
  size_t frame_len = 8 + 8 * blobs.size() + body.size();
  for (const auto& s : blobs)
    if (s.nbytes() < kLargeBlob) frame_len += s.nbytes();
  const bool inline_frame = 16 + frame_len <= kFirst;
  at::Tensor head =
      at::empty({static_cast<int64_t>(inline_frame ? 16 + frame_len : 16)}, at::TensorOptions().dtype(at::kByte));
  at::Tensor rest;
  char* out = static_cast<char*>(head.data_ptr());
  auto put = [&](const void* p, size_t n) {
    if (n) std::memcpy(out, p, n);
    out += n;
  };
  const uint32_t words[2] = {static_cast<uint32_t>(kind), 0};
  put(words, sizeof(words));
  const uint64_t len = frame_len;
  put(&len, 8);
  if (!inline_frame) {
    rest = at::empty({static_cast<int64_t>(frame_len)}, at::TensorOptions().dtype(at::kByte));
    out = static_cast<char*>(rest.data_ptr());
  }
  const uint64_t count = blobs.size();
  put(&count, 8);
  for (const auto& s : blobs) {
    const uint64_t n = s.nbytes();
    put(&n, 8);
  }
  put(body.data(), body.size());
  for (const auto& s : blobs)
    if (s.nbytes() < kLargeBlob) put(s.data(), s.nbytes());
  auto send = [&](const at::Tensor& x) {
    std::vector<at::Tensor> one{x};
    auto work = b.send(one, peer, tag);
    if (!pending) {
      work->wait(timeout());
      return;
    }
    pending->works.push_back(std::move(work));
    pending->tensors.push_back(x);
  };
  send(head);
  if (!inline_frame) send(rest);
  for (const auto& s : blobs) {
    if (s.nbytes() < kLargeBlob) continue;
    if (pending) pending->storages.push_back(s);  // alive until sent
    send(bytes_of(s));
  }
}

std::string receive_message(c10d::Backend& b, int peer, int tag, Msg& kind, std::vector<c10::Storage>* blobs,
                            std::chrono::milliseconds wait_for) {
  // The first send lands in this thread's buffer (posted whole: a send
  // may be shorter than the buffer it lands in). Nothing returned points
  // into it.
  thread_local at::Tensor head = at::empty({static_cast<int64_t>(kFirst)}, at::TensorOptions().dtype(at::kByte));
  std::vector<at::Tensor> t{head};
  b.recv(t, peer, tag)->wait(wait_for);
  const char* h = static_cast<const char*>(head.data_ptr());
  Reader r(h, kFirst);
  kind = static_cast<Msg>(r.get<uint32_t>());
  r.get<uint32_t>();
  const auto frame_len = r.get<uint64_t>();
  at::Tensor rest;
  const char* frame = h + 16;
  if (16 + frame_len > kFirst) {
    rest = at::empty({static_cast<int64_t>(frame_len)}, at::TensorOptions().dtype(at::kByte));
    std::vector<at::Tensor> more{rest};
    b.recv(more, peer, tag)->wait(timeout());
    frame = static_cast<const char*>(rest.data_ptr());
  }
  Reader fr(frame, frame_len);
  const auto count = fr.get<uint64_t>();
  TORCH_CHECK(count <= frame_len / 8, "torch_mgpu: a remote message announces ", count, " blobs");
  std::vector<uint64_t> sizes(count);
  uint64_t small_bytes = 0;
  for (auto& n : sizes) {
    n = fr.get<uint64_t>();
    if (n < kLargeBlob) small_bytes += n;
  }
  const size_t at = 8 + 8 * count;
  TORCH_CHECK(at + small_bytes <= frame_len, "torch_mgpu: a remote message's blobs overrun it");
  const size_t body_len = frame_len - at - small_bytes;
  const char* p = frame + at + body_len;
  std::vector<c10::Storage> got;
  for (auto n : sizes) {
    c10::Storage s = allocate(n);
    if (n < kLargeBlob) {
      if (n) std::memcpy(s.mutable_data(), p, n);
      p += n;
    }
    got.push_back(std::move(s));
  }
  for (const auto& s : got) {
    if (s.nbytes() < kLargeBlob) continue;
    std::vector<at::Tensor> one{bytes_of(s)};
    b.recv(one, peer, tag)->wait(timeout());
  }
  if (blobs) *blobs = std::move(got);
  return std::string(frame + at, body_len);
}

ErrorClass class_of(const std::exception& e) {
  if (dynamic_cast<const c10::IndexError*>(&e)) return ErrorClass::Index;
  if (dynamic_cast<const c10::ValueError*>(&e)) return ErrorClass::Value;
  if (dynamic_cast<const c10::TypeError*>(&e)) return ErrorClass::Type;
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return ErrorClass::NotImplemented;
  if (dynamic_cast<const c10::LinAlgError*>(&e)) return ErrorClass::LinAlg;
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) return ErrorClass::OutOfMemory;
  return ErrorClass::Error;
}

[[noreturn]] void raise_as(ErrorClass c, const std::string& msg) {
  switch (c) {
    case ErrorClass::Index: TORCH_CHECK_INDEX(false, msg);
    case ErrorClass::Value: TORCH_CHECK_VALUE(false, msg);
    case ErrorClass::Type: TORCH_CHECK_TYPE(false, msg);
    case ErrorClass::NotImplemented: TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
    case ErrorClass::LinAlg: TORCH_CHECK_LINALG(false, msg);
    case ErrorClass::OutOfMemory: TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
    case ErrorClass::Error: break;
  }
  TORCH_CHECK(false, msg);
}

} // namespace wire

std::string wire_version() {
  if (auto fake = ir::env::text(ir::env::Var::WireVersion)) return *fake;  // tests: a mismatched worker
  return "torch_mgpu 0.1.0 wire 4";  // 4: nodes carry their grad mode and thread count
}

std::string torch_version() { return TORCH_VERSION; }

std::string ProgramMessage::bytes() const {
  Writer w;
  w.put<uint64_t>(drop.size());
  for (auto id : drop) w.put<int64_t>(id);
  w.put<uint32_t>(static_cast<uint32_t>(keep.size()));
  for (auto id : keep) w.put<int64_t>(id);
  w.put<uint32_t>(static_cast<uint32_t>(forget.size()));
  for (auto k : forget) w.put<uint64_t>(k);
  w.put<uint64_t>(key);
  w.put<uint8_t>(!known);
  if (!known) w.put_string(structure);
  w.put<uint32_t>(static_cast<uint32_t>(reads.size()));
  for (auto id : reads) w.put<int64_t>(id);
  w.bytes() += values;
  return std::move(w.bytes());
}

void put_structure_head(Writer& w, c10::Device device, uint32_t slots,
                        const std::vector<std::pair<int64_t, size_t>>& allocs, uint32_t npeers,
                        const std::string& peers, uint32_t nmissing, const std::string& missing) {
  w.put<int8_t>(static_cast<int8_t>(device.type()));
  w.put<int16_t>(device.has_index() ? device.index() : 0);
  w.put<uint32_t>(slots);
  w.put<uint32_t>(static_cast<uint32_t>(allocs.size()));
  for (auto [slot, nbytes] : allocs) {
    w.put<int64_t>(slot);
    w.put<uint64_t>(nbytes);
  }
  w.put<uint32_t>(npeers);
  w.bytes() += peers;
  w.put<uint32_t>(nmissing);
  w.bytes() += missing;
}

} // namespace torch_mgpu::runtime
