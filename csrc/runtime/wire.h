#pragma once
// The wire between the controller and its workers (inside runtime/ only):
// c10d tags, one message's framing (a first send with the frame, large
// blobs on their own), sends queued and waited for later, errors that
// cross with their class. remote.h has the messages' kinds and bodies.
#include "runtime/remote.h"
#include "runtime/serialize.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <limits>
#include <string>
#include <vector>

namespace torch_mgpu::runtime::wire {

constexpr int kToWorker = 0x6d67;      // c10d tags: the controller's messages
constexpr int kToController = 0x6d68;  // the worker's
constexpr int kToPeer = 0x6d69;        // values one worker sends another

// A message's first send is at most this long: the receiver always has a
// buffer of this size posted for it (see receive_message).
constexpr size_t kFirst = (1 << 20) + 4096;

// Error classes that cross: the worker's kernel raised one, the
// controller raises the same.
enum class ErrorClass : uint8_t { Error, Index, Value, Type, NotImplemented, LinAlg, OutOfMemory };

std::chrono::milliseconds timeout();

// One message: a first send of its kind and its frame's length, followed by
// the frame when it fits in kFirst (the blobs' sizes, the body and the
// bytes of the blobs below kLargeBlob), else the frame on its own; then each
// large blob on its own, sent from and received into its storage with no
// copy. Each send is a rendezvous of the two sides' transport threads (the
// receiver says it is ready, then the bytes go), and a receiver whose
// buffer is posted before the bytes come saves one round of it: a
// receiver always has a first buffer posted for a peer it waits for. Under
// load each round waits for threads to get a core (milliseconds on two
// busy cores), so values up to half a megabyte are copied into the first
// send: two copies cost less than a round.
constexpr size_t kLargeBlob = 512 << 10;

std::chrono::milliseconds forever();

at::Tensor bytes_of(const c10::Storage& s);

// Sends queued and not yet waited for: their tensors stay alive with them.
struct Pending {
  // Destroyed last to first: the sends before the bytes they read.
  std::vector<c10::Storage> storages;  // what the tensors view
  std::vector<at::Tensor> tensors;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  void wait() {
    for (auto& w : works) w->wait(timeout());
    works.clear();
    tensors.clear();
    storages.clear();
  }
};

// With `pending`, the sends are queued there and not waited for (the
// caller goes on and waits later; a transport delivers one peer's sends in
// the order they were queued).
void send_message(c10d::Backend& b, int peer, int tag, Msg kind, const std::string& body,
                  const std::vector<c10::Storage>& blobs, Pending* pending = nullptr);

std::string receive_message(c10d::Backend& b, int peer, int tag, Msg& kind, std::vector<c10::Storage>* blobs,
                            std::chrono::milliseconds wait_for);

ErrorClass class_of(const std::exception& e);

[[noreturn]] void raise_as(ErrorClass c, const std::string& msg);

} // namespace torch_mgpu::runtime::wire
