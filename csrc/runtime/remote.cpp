// Remote: the controller's handle on one worker rank (its messages, the
// values and program structures it keeps, losing it), and the registry of
// handles over the process group. The wire is wire.h; the worker's side is
// remote_worker.cpp.
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
#include "runtime/wire.h"

namespace torch_mgpu::runtime {

using namespace wire;

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
  std::lock_guard<std::mutex> lock(residents_m_);
  bool fresh = false;
  programs_.get(
      key, [](char) { return false; }, [&](uint64_t gone, char) { forget.push_back(gone); }, &fresh);
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

} // namespace torch_mgpu::runtime
