#include "runtime/remote.h"
#include "ir/call_state.h"
#include "runtime/place.h"
#include "runtime/run_node.h"
#include "runtime/serialize.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <unordered_map>

namespace torch_mgpu::runtime {

namespace {

constexpr int kToWorker = 0x6d67;    // c10d tags: requests
constexpr int kToController = 0x6d68;  // answers
constexpr size_t kHeader = 4096;
constexpr uint32_t kMaxBlobs = 64;  // per message; larger batches are split

enum Kind : uint32_t { Hello = 1, Ping, Put, Run, Get, Free, Bye, Ok, Failed };

// Error classes that cross: the worker's kernel raised one, the
// controller raises the same.
enum class ErrorClass : uint8_t { Error, Index, Value, Type, NotImplemented, LinAlg, OutOfMemory };

std::chrono::milliseconds timeout() {
  static const auto t = [] {
    const char* s = std::getenv("TORCH_MGPU_REMOTE_TIMEOUT");
    double seconds = s ? std::atof(s) : 300.0;
    if (seconds <= 0) seconds = 300.0;
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }();
  return t;
}

at::Tensor bytes_of(const c10::Storage& s) {
  return at::from_blob(s.mutable_data(), {static_cast<int64_t>(s.nbytes())}, at::TensorOptions().dtype(at::kByte));
}

// One message over c10d: header, body beyond the header, blobs.
void send_message(c10d::Backend& b, int peer, int tag, uint32_t kind, const std::string& body,
                  const std::vector<c10::Storage>& blobs) {
  TORCH_INTERNAL_ASSERT(blobs.size() <= kMaxBlobs);
  at::Tensor head = at::zeros({static_cast<int64_t>(kHeader)}, at::TensorOptions().dtype(at::kByte));
  Writer w;
  w.put<uint32_t>(kind);
  w.put<uint32_t>(static_cast<uint32_t>(blobs.size()));
  w.put<uint64_t>(body.size());
  for (const auto& s : blobs) w.put<uint64_t>(s.nbytes());
  const size_t room = kHeader - w.bytes().size();
  const bool inline_body = body.size() <= room;
  if (inline_body) w.bytes() += body;
  std::memcpy(head.data_ptr(), w.bytes().data(), w.bytes().size());
  std::vector<at::Tensor> t{head};
  b.send(t, peer, tag)->wait(timeout());
  if (!inline_body) {
    std::vector<at::Tensor> rest{at::from_blob(const_cast<char*>(body.data()), {static_cast<int64_t>(body.size())},
                                               at::TensorOptions().dtype(at::kByte))};
    b.send(rest, peer, tag)->wait(timeout());
  }
  for (const auto& s : blobs) {
    if (s.nbytes() == 0) continue;
    std::vector<at::Tensor> one{bytes_of(s)};
    b.send(one, peer, tag)->wait(timeout());
  }
}

std::string receive_message(c10d::Backend& b, int peer, int tag, uint32_t& kind, std::vector<c10::Storage>* blobs,
                            std::chrono::milliseconds wait_for) {
  at::Tensor head = at::empty({static_cast<int64_t>(kHeader)}, at::TensorOptions().dtype(at::kByte));
  std::vector<at::Tensor> t{head};
  b.recv(t, peer, tag)->wait(wait_for);
  Reader r(static_cast<const char*>(head.data_ptr()), kHeader);
  kind = r.get<uint32_t>();
  const auto count = r.get<uint32_t>();
  TORCH_CHECK(count <= kMaxBlobs, "torch_mgpu: a remote message announces ", count, " blobs");
  const auto body_len = r.get<uint64_t>();
  std::vector<uint64_t> sizes(count);
  for (auto& s : sizes) s = r.get<uint64_t>();
  const size_t used = 16 + 8 * count;
  std::string body;
  if (body_len <= kHeader - used) {
    body.assign(static_cast<const char*>(head.data_ptr()) + used, body_len);
  } else {
    body.resize(body_len);
    std::vector<at::Tensor> rest{at::from_blob(static_cast<void*>(body.data()), {static_cast<int64_t>(body_len)},
                                               at::TensorOptions().dtype(at::kByte))};
    b.recv(rest, peer, tag)->wait(timeout());
  }
  for (auto n : sizes) {
    c10::Storage s = allocate(n);
    if (n > 0) {
      std::vector<at::Tensor> one{bytes_of(s)};
      b.recv(one, peer, tag)->wait(timeout());
    }
    if (blobs) blobs->push_back(std::move(s));
  }
  return body;
}

std::string error_text(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
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

std::string wire_version() {
  if (const char* fake = std::getenv("TORCH_MGPU_WIRE_VERSION")) return fake;  // tests: a mismatched worker
  return "torch_mgpu 0.1.0 wire 1";
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
    if (reason_.empty()) reason_ = what + " failed: " + error_text(e);
  }
  lost_ = true;
  TORCH_CHECK(false, "torch_mgpu: rank ", rank_, " stopped answering (", lost_reason(), ")");
}

void Remote::send(uint32_t kind, const std::string& body, const std::vector<c10::Storage>& blobs) {
  try {
    send_message(*backend_, rank_, kToWorker, kind, body, blobs);
  } catch (const std::exception& e) {
    lose("sending to it", e);
  }
}

std::string Remote::receive(uint32_t& kind, std::vector<c10::Storage>* blobs) {
  try {
    return receive_message(*backend_, rank_, kToController, kind, blobs, timeout());
  } catch (const std::exception& e) {
    lose("waiting for its answer", e);
  }
}

WorkerInfo Remote::hello() {
  check_alive();
  std::lock_guard<std::mutex> lock(m_);
  send(Hello, "", {});
  uint32_t kind = 0;
  std::string body = receive(kind, nullptr);
  TORCH_CHECK(kind == Ok, "torch_mgpu: rank ", rank_, " answered a greeting with message kind ", kind);
  Reader r(body);
  WorkerInfo info;
  info.version = std::string(r.get_bytes());
  info.torch_version = std::string(r.get_bytes());
  info.host = std::string(r.get_bytes());
  info.threads = r.get<int32_t>();
  return info;
}

double Remote::ping() {
  check_alive();
  std::lock_guard<std::mutex> lock(m_);
  const auto t0 = std::chrono::steady_clock::now();
  send(Ping, "", {});
  uint32_t kind = 0;
  receive(kind, nullptr);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Remote::put(int64_t id, const c10::Storage& bytes) {
  check_alive();
  TORCH_INTERNAL_ASSERT(bytes.device().is_cpu(), "torch_mgpu: bytes sent to a worker must be in host memory");
  Writer w;
  w.put<int64_t>(id);
  std::lock_guard<std::mutex> lock(m_);
  send(Put, w.bytes(), {bytes});
}

void Remote::run(const ir::Node& n, const std::vector<int64_t>& operands, const std::vector<bool>& reuse,
                 const std::vector<int64_t>& outputs) {
  check_alive();
  Writer w;
  write_node(w, n);
  w.put<uint32_t>(static_cast<uint32_t>(operands.size()));
  for (size_t k = 0; k < operands.size(); ++k) {
    w.put<int64_t>(operands[k]);
    w.put<uint8_t>(k < reuse.size() && reuse[k]);
  }
  w.put<uint32_t>(static_cast<uint32_t>(outputs.size()));
  for (auto id : outputs) w.put<int64_t>(id);
  std::string body;
  uint32_t kind = 0;
  {
    std::lock_guard<std::mutex> lock(m_);
    send(Run, w.bytes(), {});
    body = receive(kind, nullptr);
  }
  if (kind == Ok) return;
  TORCH_CHECK(kind == Failed, "torch_mgpu: rank ", rank_, " answered a node with message kind ", kind);
  Reader r(body);
  auto c = r.get<ErrorClass>();
  raise_as(c, std::string(r.get_bytes()));
}

c10::Storage Remote::get(int64_t id, size_t nbytes) {
  check_alive();
  Writer w;
  w.put<int64_t>(id);
  std::vector<c10::Storage> blobs;
  uint32_t kind = 0;
  std::string body;
  {
    std::lock_guard<std::mutex> lock(m_);
    send(Get, w.bytes(), {});
    body = receive(kind, &blobs);
  }
  if (kind == Failed) {
    Reader r(body);
    auto c = r.get<ErrorClass>();
    raise_as(c, std::string(r.get_bytes()));
  }
  TORCH_CHECK(kind == Ok && blobs.size() == 1 && blobs[0].nbytes() == nbytes, "torch_mgpu: rank ", rank_,
              " answered a request for ", nbytes, " bytes with something else");
  return blobs[0];
}

void Remote::free(const std::vector<int64_t>& ids) {
  if (ids.empty() || lost()) return;
  Writer w;
  w.put<uint64_t>(ids.size());
  for (auto id : ids) w.put<int64_t>(id);
  std::lock_guard<std::mutex> lock(m_);
  send(Free, w.bytes(), {});
}

void Remote::bye() {
  if (lost()) return;
  std::lock_guard<std::mutex> lock(m_);
  send(Bye, "", {});
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

bool serve(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string* why) {
  auto backend = pg->getBackend(c10::DeviceType::CPU);
  std::unordered_map<int64_t, c10::Storage> store;
  auto answer = [&](uint32_t kind, const std::string& body, const std::vector<c10::Storage>& blobs) {
    send_message(*backend, 0, kToController, kind, body, blobs);
  };
  auto failed = [&](const std::exception& e) {
    Writer w;
    w.put(class_of(e));
    w.put_string(error_text(e));
    answer(Failed, w.bytes(), {});
  };
  // Waiting for the next request is not bounded: a controller may be idle
  // for long. Its death closes the connection, which ends the wait.
  const auto forever = std::chrono::milliseconds(std::numeric_limits<int32_t>::max());
  while (true) {
    uint32_t kind = 0;
    std::string body;
    std::vector<c10::Storage> blobs;
    try {
      body = receive_message(*backend, 0, kToWorker, kind, &blobs, forever);
    } catch (const std::exception& e) {
      if (why) *why = "the controller (rank 0) went away: " + error_text(e);
      return false;
    }
    try {
      Reader r(body);
      switch (kind) {
        case Hello: {
          Writer w;
          w.put_string(wire_version());
          w.put_string(torch_version());
          char host[256] = {0};
          gethostname(host, sizeof(host) - 1);
          w.put_string(host);
          w.put<int32_t>(at::get_num_threads());
          answer(Ok, w.bytes(), {});
          break;
        }
        case Ping: answer(Ok, "", {}); break;
        case Put: store[r.get<int64_t>()] = blobs.at(0); break;
        case Free: {
          const auto n = r.get<uint64_t>();
          for (uint64_t k = 0; k < n; ++k) store.erase(r.get<int64_t>());
          break;
        }
        case Get: {
          const auto id = r.get<int64_t>();
          auto it = store.find(id);
          if (it == store.end()) {
            try {
              TORCH_CHECK(false, "torch_mgpu: value ", id, " is not on rank ", pg->getRank());
            } catch (const std::exception& e) {
              failed(e);
            }
            break;
          }
          answer(Ok, "", {it->second});
          break;
        }
        case Run: {
          try {
            ir::NodePtr n = read_node(r);
            const auto count = r.get<uint32_t>();
            std::vector<c10::Storage> operands;
            std::vector<bool> reuse;
            for (uint32_t k = 0; k < count; ++k) {
              const auto id = r.get<int64_t>();
              reuse.push_back(r.get<uint8_t>() != 0);
              auto it = store.find(id);
              TORCH_CHECK(it != store.end(), "torch_mgpu: value ", id, " is not on rank ", pg->getRank());
              operands.push_back(it->second);
            }
            std::vector<int64_t> out_ids(r.get<uint32_t>());
            for (auto& id : out_ids) id = r.get<int64_t>();
            TORCH_CHECK(out_ids.size() == n->outputs.size(), "torch_mgpu: a node with ", n->outputs.size(),
                        " outputs was sent with ", out_ids.size(), " output ids");
            std::vector<c10::Storage> out;
            {
              ir::CallStateGuard settings(n->state);
              out = run_node(*n, std::move(operands), reuse, Place());
            }
            ir::mark_executed(*n);
            for (size_t k = 0; k < out.size(); ++k) store[out_ids[k]] = out[k];
            answer(Ok, "", {});
          } catch (const std::exception& e) {
            failed(e);
          }
          break;
        }
        case Bye: return true;
        default: TORCH_CHECK(false, "torch_mgpu: unknown request kind ", kind);
      }
    } catch (const std::exception& e) {
      if (why) *why = "serving rank 0 failed: " + error_text(e);
      return false;
    }
  }
}

} // namespace torch_mgpu::runtime
