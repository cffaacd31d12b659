#include "runtime/remote.h"
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
#include <torch/version.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

namespace torch_mgpu::runtime {

namespace {

constexpr int kToWorker = 0x6d67;      // c10d tags: the controller's messages
constexpr int kToController = 0x6d68;  // the worker's
constexpr int kToPeer = 0x6d69;        // values one worker sends another
// A message's first send is at most this long: the receiver always has a
// buffer of this size posted for it (see receive_message).
constexpr size_t kFirst = (1 << 20) + 4096;

// Error classes that cross: the worker's kernel raised one, the
// controller raises the same.
enum class ErrorClass : uint8_t { Error, Index, Value, Type, NotImplemented, LinAlg, OutOfMemory };

std::chrono::milliseconds timeout() {
  static const auto t = [] {
    const double seconds = ir::env::positive_number(ir::env::Var::RemoteTimeout, "seconds").value_or(3600.0);
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }();
  return t;
}


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

std::chrono::milliseconds forever() { return std::chrono::milliseconds(std::numeric_limits<int32_t>::max()); }

at::Tensor bytes_of(const c10::Storage& s) {
  return at::from_blob(s.mutable_data(), {static_cast<int64_t>(s.nbytes())}, at::TensorOptions().dtype(at::kByte));
}

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
                  const std::vector<c10::Storage>& blobs, Pending* pending = nullptr) {
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

} // namespace

std::exception_ptr read_error(Reader& r, std::string* message) {
  const auto c = r.get<ErrorClass>();
  std::string msg(r.get_bytes());
  if (message) *message = msg;
  try {
    raise_as(c, msg);
  } catch (...) {
    return std::current_exception();
  }
}

std::string wire_version() {
  if (auto fake = ir::env::text(ir::env::Var::WireVersion)) return *fake;  // tests: a mismatched worker
  return "torch_mgpu 0.1.0 wire 4";  // 4: nodes carry their grad mode and thread count
}

std::string torch_version() { return TORCH_VERSION; }

Remote::Remote(c10::intrusive_ptr<c10d::ProcessGroup> pg, int rank) : pg_(std::move(pg)), rank_(rank) {
  backend_ = pg_->getBackend(c10::DeviceType::CPU);
}

std::string Remote::lost_reason() const {
  std::lock_guard<std::mutex> lock(reason_m_);
  return reason_;
}

void Remote::check_alive() const {
  TORCH_CHECK(!lost(), "torch_mgpu: rank ", rank_, " is lost (", lost_reason(),
              "); configure devices without it, or start a new process group");
}

void Remote::lose(const std::string& what, const std::exception& e) {
  {
    std::lock_guard<std::mutex> lock(reason_m_);
    if (reason_.empty()) reason_ = what + " failed: " + ir::message_of(e);
  }
  lost_ = true;
  TORCH_CHECK(false, "torch_mgpu: rank ", rank_, " stopped answering (", lost_reason(), ")");
}

void Remote::send(Msg kind, const std::string& body, const std::vector<c10::Storage>& blobs) {
  check_alive();
  size_t bytes = 16 + body.size();  // the kind and lengths, the body, the values
  for (const auto& b : blobs) bytes += b.nbytes();
  counters().remote_bytes_sent += static_cast<int64_t>(bytes);
  try {
    send_message(*backend_, rank_, kToWorker, kind, body, blobs);
  } catch (const std::exception& e) {
    lose("sending to it", e);
  }
}

std::string Remote::receive(Msg& kind, std::vector<c10::Storage>* blobs) {
  check_alive();
  try {
    std::vector<c10::Storage> got;
    std::string body = receive_message(*backend_, rank_, kToController, kind, &got, timeout());
    size_t bytes = 16 + body.size();  // the kind and lengths, the body, the values
    for (const auto& b : got) bytes += b.nbytes();
    counters().remote_bytes_received += static_cast<int64_t>(bytes);
    if (blobs) *blobs = std::move(got);
    return body;
  } catch (const std::exception& e) {
    lose("waiting for it", e);
  }
}

WorkerInfo Remote::hello() {
  std::lock_guard<std::mutex> lock(m_);
  send(Msg::Hello, "", {});
  Msg kind{};
  std::string body = receive(kind, nullptr);
  TORCH_CHECK(kind == Msg::Ok, "torch_mgpu: rank ", rank_, " answered a greeting with message kind ",
              static_cast<uint32_t>(kind));
  Reader r(body);
  WorkerInfo info;
  info.version = std::string(r.get_bytes());
  info.torch_version = std::string(r.get_bytes());
  info.host = std::string(r.get_bytes());
  info.threads = r.get<int32_t>();
  // (A worker of another wire version may not say: the version check
  // names the mismatch.)
  info.cuda_devices = r.left() >= 4 ? r.get<int32_t>() : 0;
  return info;
}

double Remote::ping() {
  std::lock_guard<std::mutex> lock(m_);
  const auto t0 = std::chrono::steady_clock::now();
  send(Msg::Ping, "", {});
  Msg kind{};
  receive(kind, nullptr);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

c10::Storage Remote::get(int64_t id, size_t nbytes) {
  Writer w;
  w.put<int64_t>(id);
  std::vector<c10::Storage> blobs;
  Msg kind{};
  std::string body;
  {
    std::lock_guard<std::mutex> lock(m_);
    send(Msg::Get, w.bytes(), {});
    body = receive(kind, &blobs);
  }
  if (kind == Msg::Failed) {
    Reader r(body);
    auto c = r.get<ErrorClass>();
    raise_as(c, std::string(r.get_bytes()));
  }
  // (A storage may hold more than the value it carries.)
  TORCH_CHECK(kind == Msg::Ok && blobs.size() == 1 && blobs[0].nbytes() >= nbytes, "torch_mgpu: rank ", rank_,
              " answered a request for ", nbytes, " bytes with something else");
  return blobs[0];
}

void Remote::free(const std::vector<int64_t>& ids) {
  if (lost()) return;
  Writer w;
  w.put<uint64_t>(ids.size());
  for (auto id : ids) w.put<int64_t>(-id);
  std::lock_guard<std::mutex> lock(m_);
  send(Msg::Free, w.bytes(), {});
}

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

double Remote::probe_bandwidth(size_t nbytes) {
  c10::Storage probe = allocate(nbytes);
  std::memset(probe.mutable_data(), 0, nbytes);
  ProgramMessage m;  // a program of no steps, on the worker's CPU, that keeps the probe
  m.keep.push_back(next_id());
  Writer empty;
  put_structure_head(empty, c10::Device(c10::kCPU), 0, {}, 0, "", 0, "");
  empty.put<uint32_t>(0);  // steps
  m.structure = std::move(empty.bytes());
  const int64_t id = m.keep[0];
  std::lock_guard<std::mutex> lock(m_);
  const auto t0 = std::chrono::steady_clock::now();
  send(Msg::Exec, m.bytes(), {probe});
  Msg kind{};
  receive(kind, nullptr);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  TORCH_CHECK(kind == Msg::End, "torch_mgpu: rank ", rank_, " answered a probe with message kind ",
              static_cast<uint32_t>(kind));
  Writer f;
  f.put<uint64_t>(1);
  f.put<int64_t>(-id);
  send(Msg::Free, f.bytes(), {});
  return took;
}

void Remote::bye() {
  if (lost()) return;
  std::lock_guard<std::mutex> lock(m_);
  send(Msg::Bye, "", {});
}

int64_t Remote::resident(const ir::NodePtr& leaf, bool& fresh, std::vector<int64_t>& dead) {
  std::lock_guard<std::mutex> lock(residents_m_);
  if (residents_.size() > 64) {  // now and then: the leaves that died since
    for (auto it = residents_.begin(); it != residents_.end();) {
      if (it->second.first.expired()) {
        dead.push_back(it->second.second);
        it = residents_.erase(it);
      } else {
        ++it;
      }
    }
  }
  auto it = residents_.find(leaf.get());
  if (it != residents_.end()) {
    if (it->second.first.lock() == leaf) {
      fresh = false;
      return it->second.second;
    }
    dead.push_back(it->second.second);  // another node at a dead one's address
    residents_.erase(it);
  }
  fresh = true;
  const int64_t id = next_id();
  residents_.emplace(leaf.get(), std::make_pair(std::weak_ptr<ir::Node>(leaf), id));
  return id;
}

bool Remote::knows_program(uint64_t key, std::vector<uint64_t>& forget) {
  constexpr size_t kPrograms = 256;
  std::lock_guard<std::mutex> lock(residents_m_);
  auto [it, fresh] = programs_.try_emplace(key, 0);
  it->second = ++tick_;
  while (programs_.size() > kPrograms) {
    auto oldest = programs_.begin();
    for (auto p = programs_.begin(); p != programs_.end(); ++p)
      if (p->second < oldest->second) oldest = p;
    forget.push_back(oldest->first);
    programs_.erase(oldest);
  }
  return !fresh;
}

void Remote::poison(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(reason_m_);
    if (reason_.empty()) reason_ = why;
  }
  lost_ = true;
}

void Remote::unregister(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(residents_m_);
  for (auto it = residents_.begin(); it != residents_.end();) {
    if (std::find(ids.begin(), ids.end(), it->second.second) != ids.end()) it = residents_.erase(it);
    else ++it;
  }
}

void Remote::forget_residents() {
  std::lock_guard<std::mutex> lock(residents_m_);
  residents_.clear();
  programs_.clear();
}

namespace {
struct Registry {
  std::mutex m;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  std::map<int, std::shared_ptr<Remote>> remotes;
};
Registry& registry() {
  static auto* r = new Registry();  // leaked: lanes may outlive static teardown
  return *r;
}
} // namespace

void set_process_group(c10::intrusive_ptr<c10d::ProcessGroup> pg) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  if (r.pg.get() == pg.get()) return;
  r.pg = std::move(pg);
  r.remotes.clear();
}

c10::intrusive_ptr<c10d::ProcessGroup> process_group() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  return r.pg;
}

std::shared_ptr<Remote> remote(int rank) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  TORCH_CHECK(r.pg, "torch_mgpu: remote device 'rank", rank,
              "' needs a torch.distributed process group, and none is initialized "
              "(torch.distributed.init_process_group, or start the program with torchrun -m torch_mgpu.launch)");
  TORCH_CHECK(r.pg->getRank() == 0, "torch_mgpu: remote devices are configured on rank 0 (the controller); this is rank ",
              r.pg->getRank());
  TORCH_CHECK(rank != 0, "torch_mgpu: 'rank0' is this process: name its devices without a rank ('cpu')");
  TORCH_CHECK(rank > 0 && rank < r.pg->getSize(), "torch_mgpu: unknown rank ", rank, " (the process group has ",
              r.pg->getSize(), " rank(s): 0 to ", r.pg->getSize() - 1, ")");
  auto& slot = r.remotes[rank];
  if (!slot) slot = std::make_shared<Remote>(r.pg, rank);
  return slot;
}

void release_workers() {
  std::map<int, std::shared_ptr<Remote>> all;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.m);
    if (!r.pg || r.pg->getRank() != 0) return;
    for (int rank = 1; rank < r.pg->getSize(); ++rank) {
      auto& slot = r.remotes[rank];
      if (!slot) slot = std::make_shared<Remote>(r.pg, rank);
    }
    all = r.remotes;
  }
  for (auto& [rank, rem] : all) {
    try {
      rem->bye();
    } catch (const std::exception&) {
      // Gone already: nothing to release.
    }
  }
}

namespace {

// A worker's side: the values it keeps between runs (by id), and the slots
// of the program it ran last (kept until the controller has read what it
// needs of them).
struct Worker {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::unordered_map<int64_t, c10::Storage> store;
  std::vector<c10::Storage> slots;

  Pending pending;  // a program's exports, sent while it goes on
  // Its values for other workers, each message's sends kept (with the
  // bytes they read) until they are done: a worker takes them when its
  // steps need them, perhaps long after this one has moved on, and one
  // that went away never does. Nothing waits for them.
  std::list<Pending> to_peers;
  // Workers whose messages can no longer be read in step (one went away,
  // or sent what no program reads): their values are lost from then on.
  std::set<int> distrusted;
  void send_to_peer(int peer, Msg kind, int64_t key, const std::vector<c10::Storage>& blobs) {
    Writer w;
    w.put<int64_t>(key);
    try {
      to_peers.emplace_back();
      send_message(*backend, peer, kToPeer, kind, w.bytes(), blobs, &to_peers.back());
    } catch (const std::exception&) {
      // That worker is gone: the controller fails what it ran.
    }
  }
  // Drops the messages to other workers that are sent (or failed: their
  // worker went away).
  void reap_peer_sends() {
    to_peers.remove_if([](const Pending& p) {
      return std::all_of(p.works.begin(), p.works.end(), [](const auto& w) { return w->isCompleted(); });
    });
  }
  void answer(Msg kind, const std::string& body, const std::vector<c10::Storage>& blobs) {
    pending.wait();
    send_message(*backend, 0, kToController, kind, body, blobs);
  }
  static void write_error(Writer& w, const std::exception& e) {
    w.put(class_of(e));
    w.put_string(ir::message_of(e));
  }
  // Bytes on the host, to send (a copy of device memory, made now).
  static c10::Storage host(const c10::Storage& s) {
    return s.device().is_cpu() ? s : copy_to(s, c10::Device(c10::kCPU), /*wait=*/true);
  }
  // Bytes on `device`: values arrive in host memory, a kept value stays
  // where it was last used, and an allocation for a device is a
  // placeholder of its size until then.
  static c10::Storage& on(c10::Storage& s, c10::Device device) {
    if (s.device() == device) return s;
    s = s.device().type() == c10::kMeta ? allocate(s.nbytes(), device) : copy_to(s, device);
    return s;
  }

  c10::Storage& value(int64_t ref) {
    if (ref >= 0) {
      TORCH_CHECK(static_cast<size_t>(ref) < slots.size() && slots[ref], "torch_mgpu: slot ", ref,
                  " of the last run is not on rank ", pg->getRank());
      return slots[ref];
    }
    auto it = store.find(-ref);
    TORCH_CHECK(it != store.end(), "torch_mgpu: value ", -ref, " is not on rank ", pg->getRank());
    return it->second;
  }

  struct Step {
    ir::NodePtr node;
    std::vector<int> holes;        // its arguments given with each run
    std::vector<int64_t> kept;     // this run: ids of the kept values it reads, in order
    std::vector<int64_t> refs;
    std::vector<bool> reuse;
    std::vector<int64_t> outs;
    std::vector<char> exported;
    // Per output: the worker ranks it goes to as soon as it is made (they
    // read it), and its key there.
    std::vector<std::vector<int>> forward;
    std::vector<int64_t> keys;
  };
  // An input that another worker sends straight here.
  struct PeerInput {
    int64_t slot;
    int peer;
    int64_t key;
  };

  // A lane's program: its inputs come with it or after it (Import /
  // Missing, in the order its steps need them); each step's exported
  // outputs go back as soon as it has run, and its error if it fails; End
  // gives every step's status and times.
  struct Program {
    c10::Device device{c10::kCPU};  // where its steps run
    size_t slots = 0;
    std::vector<std::pair<int64_t, uint64_t>> allocs;
    std::vector<PeerInput> from_peers;
    // Values this program would have sent to other workers, which they are
    // told will not come (the program of a lane that could not be built).
    std::vector<std::pair<int, int64_t>> missing;
    std::vector<Step> steps;
  };
  std::unordered_map<uint64_t, Program> programs;  // kept structures, by key

  // Each tensor a step views lies inside its operand's bytes (a malformed
  // program raises here instead of reading or writing outside them).
  static void check_views(const Step& st, const std::vector<c10::Storage>& operands) {
    for (const auto& a : st.node->args)
      for (const auto& t : a.tensors) {
        if (!t) continue;
        const auto& g = t->geom;
        TORCH_CHECK(t->operand >= 0 && static_cast<size_t>(t->operand) < operands.size(),
                    "torch_mgpu: a view of operand ", t->operand, " of ", operands.size());
        TORCH_CHECK(static_cast<int>(g.dtype) >= 0 && static_cast<int>(g.dtype) < static_cast<int>(c10::ScalarType::NumOptions),
                    "torch_mgpu: a view has an unknown dtype");
        TORCH_CHECK(g.offset >= 0, "torch_mgpu: a view has a negative offset");
        for (auto stride : g.strides) TORCH_CHECK(stride >= 0, "torch_mgpu: a view has a negative stride");
        const size_t item = c10::elementSize(g.dtype);
        const size_t need = at::detail::computeStorageNbytes(g.sizes, g.strides, item) + static_cast<size_t>(g.offset) * item;
        TORCH_CHECK(need <= operands[t->operand].nbytes() || c10::multiply_integers(g.sizes) == 0,
                    "torch_mgpu: a view needs ", need, " bytes of an operand of ", operands[t->operand].nbytes());
      }
  }

  static Program read_program(Reader& r, int rank, int world) {
    Program p;
    auto peer_rank = [&] {
      const auto peer = r.get<int32_t>();
      TORCH_CHECK(peer > 0 && peer < world && peer != rank, "torch_mgpu: a program names rank ", peer,
                  " as a worker beside rank ", rank, " (world of ", world, ")");
      return static_cast<int>(peer);
    };
    const auto type = static_cast<c10::DeviceType>(r.get<int8_t>());
    const auto index = r.get<int16_t>();
    TORCH_CHECK(type == c10::DeviceType::CPU || type == c10::DeviceType::CUDA,
                "torch_mgpu: a program for device type ", static_cast<int>(type));
    if (type == c10::DeviceType::CUDA) {
      TORCH_CHECK(index >= 0 && index < cuda_device_count(), "torch_mgpu: a program for cuda:", index,
                  ", and this rank sees ", cuda_device_count(), " CUDA device(s)");
      p.device = c10::Device(type, static_cast<c10::DeviceIndex>(index));
      init_cuda();  // a worker may not have used CUDA yet
    }
    p.slots = r.get<uint32_t>();
    TORCH_CHECK(p.slots <= (1u << 24), "torch_mgpu: a program with ", p.slots, " slots");
    const auto allocs = r.get<uint32_t>();
    for (uint32_t k = 0; k < allocs; ++k) {
      const auto slot = r.get<int64_t>();
      TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(p.slots), "torch_mgpu: an allocation for slot ", slot,
                  " of ", p.slots);
      p.allocs.emplace_back(slot, r.get<uint64_t>());
    }
    const auto peers = r.get<uint32_t>();
    TORCH_CHECK(peers <= r.left() / 20, "torch_mgpu: a program announces ", peers, " inputs from other workers");
    for (uint32_t k = 0; k < peers; ++k) {
      PeerInput in;
      in.slot = r.get<int64_t>();
      TORCH_CHECK(in.slot >= 0 && in.slot < static_cast<int64_t>(p.slots), "torch_mgpu: an input for slot ", in.slot,
                  " of ", p.slots);
      in.peer = peer_rank();
      in.key = r.get<int64_t>();
      p.from_peers.push_back(in);
    }
    const auto missing = r.get<uint32_t>();
    TORCH_CHECK(missing <= r.left() / 12, "torch_mgpu: a program announces ", missing, " values it will not send");
    for (uint32_t k = 0; k < missing; ++k) {
      const int peer = peer_rank();
      p.missing.emplace_back(peer, r.get<int64_t>());
    }
    p.steps.resize(r.get<uint32_t>());
    for (auto& st : p.steps) {
      uint32_t operands = 0;
      st.node = read_node(r, st.holes, &operands);
      const auto n = r.get<uint32_t>();
      TORCH_CHECK(n == operands, "torch_mgpu: a node of ", operands, " operands was sent with ", n);
      for (uint32_t k = 0; k < n; ++k) {
        st.refs.push_back(r.get<int64_t>());
        st.reuse.push_back(r.get<uint8_t>() != 0);
        TORCH_CHECK(st.refs.back() < static_cast<int64_t>(p.slots), "torch_mgpu: a step reads slot ",
                    st.refs.back(), " of ", p.slots);
      }
      const auto outs = r.get<uint32_t>();
      TORCH_CHECK(outs == st.node->outputs.size(), "torch_mgpu: a node with ", st.node->outputs.size(),
                  " outputs was sent with ", outs, " output slots");
      for (uint32_t k = 0; k < outs; ++k) {
        st.outs.push_back(r.get<int64_t>());
        st.exported.push_back(static_cast<char>(r.get<uint8_t>()));
        TORCH_CHECK(st.outs.back() >= 0 && st.outs.back() < static_cast<int64_t>(p.slots),
                    "torch_mgpu: a step writes slot ", st.outs.back(), " of ", p.slots);
        const auto nto = r.get<uint32_t>();
        TORCH_CHECK(nto < static_cast<uint32_t>(world), "torch_mgpu: a step's output goes to ", nto, " workers");
        std::vector<int> to(nto);
        for (auto& peer : to) peer = peer_rank();
        TORCH_CHECK(std::set<int>(to.begin(), to.end()).size() == to.size(),
                    "torch_mgpu: a step's output goes to one worker twice");
        st.keys.push_back(to.empty() ? -1 : r.get<int64_t>());
        st.forward.push_back(std::move(to));
      }
    }
    TORCH_CHECK(r.done(), "torch_mgpu: a program's structure has bytes left over");
    // Each slot is filled one way at most (an allocation, a value from
    // another worker, a step's output; the rest come from the controller),
    // and each value from another worker has one slot: else a message would
    // be left unread, or read into the wrong run.
    std::vector<char> filled(p.slots, 0);
    auto fill = [&](int64_t slot) {
      TORCH_CHECK(!filled[slot], "torch_mgpu: a program fills slot ", slot, " twice");
      filled[slot] = 1;
    };
    for (const auto& a : p.allocs) fill(a.first);
    std::set<std::pair<int, int64_t>> keys;
    for (const auto& in : p.from_peers) {
      fill(in.slot);
      TORCH_CHECK(keys.insert({in.peer, in.key}).second, "torch_mgpu: a program reads value ", in.key, " of rank ",
                  in.peer, " twice");
    }
    for (const auto& st : p.steps)
      for (auto o : st.outs) fill(o);
    return p;
  }

  // A lane's program: its inputs come with it or after it (Import /
  // Missing, in the order its steps need them); each step's exported
  // outputs go back as soon as it has run, and its error if it fails; End
  // gives every step's status and times, and the results.
  void exec(Reader& r, std::vector<c10::Storage>& blobs) {
    size_t b = 0;
    const auto dead = r.get<uint64_t>();
    for (uint64_t k = 0; k < dead; ++k) store.erase(r.get<int64_t>());
    const auto puts = r.get<uint32_t>();
    for (uint32_t k = 0; k < puts; ++k) store[r.get<int64_t>()] = blobs.at(b++);
    const auto forget = r.get<uint32_t>();
    for (uint32_t k = 0; k < forget; ++k) programs.erase(r.get<uint64_t>());
    const auto key = r.get<uint64_t>();
    if (r.get<uint8_t>()) {
      Reader structure(r.get_bytes());
      programs[key] = read_program(structure, pg->getRank(), pg->getSize());
    }
    auto found = programs.find(key);
    TORCH_CHECK(found != programs.end(), "torch_mgpu: rank ", pg->getRank(), " was asked to run program ", key,
                ", which it does not keep");
    Program& prog = found->second;
    const auto nparams = r.get<uint32_t>();
    TORCH_CHECK(nparams <= r.left() / 8, "torch_mgpu: a program announces ", nparams, " kept values");
    std::vector<int64_t> params(nparams);
    for (auto& id : params) id = r.get<int64_t>();
    for (auto& st : prog.steps) {
      patch_node(*st.node, st.holes, r);

      st.kept.clear();
      for (auto ref : st.refs) {
        if (ref >= 0) continue;
        const auto j = static_cast<size_t>(-1 - ref);
        TORCH_CHECK(j < params.size(), "torch_mgpu: a step reads kept value ", j, " of ", params.size());
        st.kept.push_back(params[j]);
      }
    }
    TORCH_CHECK(r.done(), "torch_mgpu: a program's values have bytes left over");
    auto& steps = prog.steps;
    // Where the steps run: this rank's CPU, or one of its CUDA devices
    // (each step on the device's current stream, waited for after it: a
    // step's error and times are its own).
    const c10::Device device = prog.device;
    Place here;
    here.device = device;
    std::optional<c10::DeviceGuard> on_device;
    if (!device.is_cpu()) {
      on_device.emplace(device);
      here.stream = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
      here.streams = true;
    }
    slots.assign(prog.slots, c10::Storage());
    enum : char { Absent, Present, Lost };
    std::vector<char> state(slots.size(), Absent);
    for (auto [slot, nbytes] : prog.allocs) {
      slots[slot] = device.is_cpu() ? allocate(nbytes) : placeholder(nbytes);
      state[slot] = Present;
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto now = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    // Inputs other workers send: by (rank, key), each rank's in the order
    // it sends them. A rank that goes away loses what it had to send.
    std::vector<int> peer_of(slots.size(), -1);
    std::map<std::pair<int, int64_t>, int64_t> peer_slot;
    for (const auto& in : prog.from_peers) {
      peer_of[in.slot] = in.peer;
      peer_slot[{in.peer, in.key}] = in.slot;
    }
    auto next_from_peer = [&](int peer) {
      try {
        TORCH_CHECK(!distrusted.count(peer), "torch_mgpu: rank ", peer, " was lost before");
        Msg kind{};
        std::vector<c10::Storage> got;
        std::string body = receive_message(*backend, peer, kToPeer, kind, &got, timeout());
        Reader pr(body);
        auto it = peer_slot.find({peer, pr.get<int64_t>()});
        TORCH_CHECK(it != peer_slot.end(), "torch_mgpu: rank ", peer, " sent a value this program does not read");
        const int64_t slot = it->second;
        TORCH_CHECK(state[slot] == Absent, "torch_mgpu: rank ", peer, " sent slot ", slot, " twice");
        if (kind == Msg::Import) {
          TORCH_CHECK(got.size() == 1, "torch_mgpu: rank ", peer, " sent a value in ", got.size(), " parts");
          slots[slot] = got[0];  // moved to the device by the step that reads it
          state[slot] = Present;
        } else {
          TORCH_CHECK(kind == Msg::Missing, "torch_mgpu: rank ", peer, " sent message kind ",
                      static_cast<uint32_t>(kind));
          state[slot] = Lost;
        }
      } catch (const std::exception&) {
        // That worker went away (Gloo raises its I/O errors as they come),
        // or its messages are out of step: what it had to send is lost,
        // and it is not listened to again.
        distrusted.insert(peer);
        for (size_t k = 0; k < slots.size(); ++k)
          if (peer_of[k] == peer && state[k] == Absent) state[k] = Lost;
      }
    };
    // A program that could not be built here: the values it would have
    // sent other workers will not come.
    for (auto [peer, k] : prog.missing) send_to_peer(peer, Msg::Missing, k, {});
    // Waits for the controller's next input of this run.
    auto next_input = [&] {
      Msg kind{};
      std::vector<c10::Storage> got;
      // As long as the controller's lanes take: its death closes the connection.
      std::string body = receive_message(*backend, 0, kToWorker, kind, &got, forever());
      Reader ir(body);
      const auto slot = ir.get<int64_t>();
      TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(slots.size()), "torch_mgpu: an input for slot ", slot,
                  " of ", slots.size());
      if (kind == Msg::Import) {
        slots[slot] = got.at(0);  // moved to the device by the step that reads it
        state[slot] = Present;
      } else {
        TORCH_CHECK(kind == Msg::Missing, "torch_mgpu: message kind ", static_cast<uint32_t>(kind),
                    " came while a program ran");
        state[slot] = Lost;
      }
    };
    // Each run slot's last reader: it is freed after it, unless it is a
    // result (sent with End). A failure keeps every slot, for the reads
    // the controller then makes.
    std::vector<int64_t> last_use(slots.size(), -1);
    std::vector<char> result(slots.size(), 0);
    for (size_t s = 0; s < steps.size(); ++s) {
      for (auto ref : steps[s].refs)
        if (ref >= 0) last_use[ref] = static_cast<int64_t>(s);
      for (size_t k = 0; k < steps[s].outs.size(); ++k)
        if (steps[s].exported[k] == 2) result[steps[s].outs[k]] = 1;
    }
    bool any_failed = false;
    std::vector<c10::Storage> results;
    Writer result_ids;
    Writer end;
    for (size_t s = 0; s < steps.size(); ++s) {
      Step& st = steps[s];
      uint8_t status = 1;  // 1 ran, 2 failed, 3 skipped (an input was lost)
      // Its operands where they are kept (a run's slot, or a value kept
      // from run to run), moved to the device when the step runs.
      std::vector<c10::Storage*> where;
      std::vector<c10::Storage> operands;
      size_t kept = 0;
      for (auto ref : st.refs) {
        if (ref >= 0) {
          // Every input the controller sends is taken, even for a step
          // that will not run: what is left unread would be taken as the
          // next request.
          while (state[ref] == Absent) peer_of[ref] >= 0 ? next_from_peer(peer_of[ref]) : next_input();
          if (state[ref] == Lost) status = 3;
          else where.push_back(&slots[ref]);
        } else {
          where.push_back(&value(-st.kept[kept++]));
        }
      }
      for (auto* w : where) operands.push_back(*w);
      if (status == 1) check_views(st, operands);
      const double start = now();  // its inputs are here
      std::vector<c10::Storage> forwarded;
      if (status == 1) {
        try {
          // (On a device, a copy there that fails, such as one out of
          // memory, fails the step.)
          for (size_t k = 0; k < where.size(); ++k) operands[k] = on(*where[k], device);
          std::vector<c10::Storage> out;
          {
            ir::CallStateGuard settings(st.node->state);
            out = run_node(*st.node, std::move(operands), st.reuse, here);
            if (here.streams) here.stream.synchronize();
          }
          // What other workers read, in host memory (before anything is
          // sent: a copy that fails fails the step).
          forwarded.assign(out.size(), c10::Storage());
          for (size_t k = 0; k < out.size(); ++k)
            if (!st.forward[k].empty()) forwarded[k] = host(out[k]);
          std::vector<c10::Storage> sent;
          Writer w;
          w.put<uint32_t>(static_cast<uint32_t>(s));
          for (size_t k = 0; k < out.size(); ++k) {
            slots[st.outs[k]] = out[k];
            state[st.outs[k]] = Present;
            if (st.exported[k] == 1) {
              w.put<uint32_t>(static_cast<uint32_t>(k));
              sent.push_back(host(out[k]));
            } else if (st.exported[k] == 2) {
              result_ids.put<uint32_t>(static_cast<uint32_t>(s));
              result_ids.put<uint32_t>(static_cast<uint32_t>(k));
              results.push_back(host(out[k]));
            }
          }
          if (!sent.empty()) send_message(*backend, 0, kToController, Msg::Export, w.bytes(), sent, &pending);
        } catch (const c10::DistError&) {
          throw;  // the connection, not the op
        } catch (const std::exception& e) {
          status = 2;
          Writer w;
          w.put<uint32_t>(static_cast<uint32_t>(s));
          write_error(w, e);
          answer(Msg::Failed, w.bytes(), {});
        }
      }
      // Outputs other workers read go to them now (a failed step's: word
      // that they will not come).
      for (size_t k = 0; k < st.outs.size(); ++k)
        for (int peer : st.forward[k])
          status == 1 ? send_to_peer(peer, Msg::Import, st.keys[k], {forwarded[k]})
                      : send_to_peer(peer, Msg::Missing, st.keys[k], {});
      if (status == 3) {
        Writer w;
        w.put<uint32_t>(static_cast<uint32_t>(s));
        answer(Msg::Skipped, w.bytes(), {});
      }
      if (status != 1) {
        any_failed = true;
        for (auto o : st.outs) state[o] = Lost;
      }
      if (!any_failed) {
        for (auto ref : st.refs)
          if (ref >= 0 && last_use[ref] == static_cast<int64_t>(s) && !result[ref]) slots[ref] = c10::Storage();
        for (auto o : st.outs)
          if (last_use[o] < 0 && !result[o]) slots[o] = c10::Storage();
      }
      end.put<uint8_t>(status);
      end.put<double>(start);
      end.put<double>(now());
    }
    // Every value other workers send this program is taken (a program of
    // no steps takes them here).
    for (size_t k = 0; k < slots.size(); ++k)
      while (peer_of[k] >= 0 && state[k] == Absent) next_from_peer(peer_of[k]);
    end.bytes() += result_ids.bytes();
    answer(Msg::End, end.bytes(), results);
    reap_peer_sends();
    if (!any_failed) slots.clear();
  }
};

} // namespace

bool serve(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string* why) {
  Worker wk;
  wk.pg = pg;
  wk.backend = pg->getBackend(c10::DeviceType::CPU);
  // Waiting for the next request is not bounded: a controller may be idle
  // for long. Its death closes the connection, which ends the wait.
  while (true) {
    Msg kind{};
    std::string body;
    std::vector<c10::Storage> blobs;
    try {
      body = receive_message(*wk.backend, 0, kToWorker, kind, &blobs, forever());
    } catch (const std::exception& e) {
      if (why) *why = "the controller (rank 0) went away: " + ir::message_of(e);
      return false;
    }
    try {
      Reader r(body);
      switch (kind) {
        case Msg::Hello: {
          Writer w;
          w.put_string(wire_version());
          w.put_string(torch_version());
          char host[256] = {0};
          gethostname(host, sizeof(host) - 1);
          w.put_string(host);
          w.put<int32_t>(at::get_num_threads());
          w.put<int32_t>(cuda_device_count());
          wk.answer(Msg::Ok, w.bytes(), {});
          break;
        }
        case Msg::Ping: wk.answer(Msg::Ok, "", {}); break;
        case Msg::Free: {
          const auto n = r.get<uint64_t>();
          for (uint64_t k = 0; k < n; ++k) {
            const auto id = r.get<int64_t>();
            if (id < 0) wk.store.erase(-id);
          }
          wk.slots.clear();
          break;
        }
        case Msg::Get: {
          c10::Storage found;
          try {
            found = Worker::host(wk.value(r.get<int64_t>()));
          } catch (const std::exception& e) {
            Writer w;
            Worker::write_error(w, e);
            wk.answer(Msg::Failed, w.bytes(), {});
            break;
          }
          wk.answer(Msg::Ok, "", {found});
          break;
        }
        case Msg::Exec: wk.exec(r, blobs); break;
        case Msg::Bye: return true;
        default: TORCH_CHECK(false, "torch_mgpu: unknown request kind ", static_cast<uint32_t>(kind));
      }
    } catch (const std::exception& e) {
      if (why) *why = "serving rank 0 failed: " + ir::message_of(e);
      return false;
    }
  }
}

} // namespace torch_mgpu::runtime
