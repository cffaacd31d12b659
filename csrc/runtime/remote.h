#pragma once
// Lanes in other processes: a worker rank of a torch.distributed process
// group (Gloo on CPU) runs the nodes a plan gives its lane. The controller
// (rank 0, the user's program) sends each node as data (runtime/serialize.h)
// with the ids of its operands' bytes on the worker, the bytes the worker
// lacks, and asks for the bytes it needs back. Only rank 0 of the worker's
// own process group is listened to; a message is never run as code.
//
// Messages are c10d send/recv pairs: a fixed-size header (kind, body,
// sizes of the bulk blobs that follow) and each blob as its own byte tensor,
// sent from and received into a storage's bytes without a copy.
//
// Faults: every wait for a worker is bounded (TORCH_MGPU_REMOTE_TIMEOUT
// seconds, default 3600: a node may legitimately run long; a closed
// connection, as when a worker dies, is seen at once). A rank that fails to answer is
// marked lost: every later call on it raises an error naming it, and
// configure() refuses it until a new process group brings it back. A worker
// whose controller goes away returns from serve().
#include "ir/lru.h"
#include "ir/node.h"
#include "runtime/serialize.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch_mgpu::runtime {

// What a worker says about itself when asked.
struct WorkerInfo {
  std::string version;        // torch_mgpu's wire version
  std::string torch_version;
  std::string host;
  int threads = 1;            // its intra-op threads
  int cuda_devices = 0;       // CUDA devices it sees
};

// This build's wire version and torch's version, as a worker reports them.
std::string wire_version();
std::string torch_version();

// Messages between the controller and a worker.
enum class Msg : uint32_t {
  Hello = 1, Ping, Get, Free, Bye,  // requests (Get, Hello and Ping are answered)
  Exec,      // a lane's program for one run, with the inputs ready now
  Import,    // an input of the running program, made since on another lane
  Missing,   // an input that will not come (its op failed)
  Ok,        // answers
  Failed,    // an answer's error, or a program step's (class, message)
  Export,    // a program step's outputs that other lanes read
  End,       // the program ran: each step's status and times
  Skipped,   // a program step did not run (an input was lost)
};

class Remote {
 public:
  Remote(c10::intrusive_ptr<c10d::ProcessGroup> pg, int rank);
  int rank() const { return rank_; }
  std::string name() const { return "rank" + std::to_string(rank_); }

  WorkerInfo hello();
  // Seconds for one empty request and its answer.
  double ping();
  // The bytes of slot `ref` of the last program (ref >= 0) or of the
  // value kept under id -ref, in host memory (`nbytes` of them).
  c10::Storage get(int64_t ref, size_t nbytes);
  // Drops the last program's slots and the values kept under `ids`.
  void free(const std::vector<int64_t>& ids);
  // Seconds to send `nbytes` and hear back (a program of no steps with
  // one input, dropped after).
  double probe_bandwidth(size_t nbytes);
  // Asks the worker to stop serving (the controller is done).
  void bye();

  // A running program's traffic: the lane's thread sends, a receiver
  // thread receives (no request waits for an answer meanwhile).
  void send(Msg kind, const std::string& body, const std::vector<c10::Storage>& blobs);
  std::string receive(Msg& kind, std::vector<c10::Storage>* blobs);

  // Materialized values kept on the worker from one run to the next (a
  // model's weights, a database): the id of `leaf`'s bytes there, and
  // whether they still have to be sent (`fresh`). Ids of leaves that died
  // since are handed to `dead` (the worker drops them).
  int64_t resident(const ir::NodePtr& leaf, bool& fresh, std::vector<int64_t>& dead);
  // Whether the worker keeps the program structure `key` (sent before);
  // records that it will after this run. Keys it should forget (the least
  // recently used beyond a bound) are handed to `forget`.
  bool knows_program(uint64_t key, std::vector<uint64_t>& forget);
  // Forgets the residents and programs (a run that sent them failed part-way).
  void forget_residents();
  // Forgets the residents under `ids` (a program that would have sent them
  // was never sent).
  void unregister(const std::vector<int64_t>& ids);

  bool lost() const { return lost_.load(); }
  // Marks the rank lost (its connection can no longer be trusted).
  void poison(const std::string& why);
  std::string lost_reason() const;
  void check_alive() const;
  // A fresh id for bytes on this worker.
  int64_t next_id() { return next_id_.fetch_add(1); }

 private:
  [[noreturn]] void lose(const std::string& what, const std::exception& e);

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  int rank_;
  std::mutex m_;       // one request and its answer at a time; a program's sends
  std::atomic<bool> lost_{false};
  mutable std::mutex reason_m_;
  std::string reason_;
  std::atomic<int64_t> next_id_{1};
  std::mutex residents_m_;
  std::unordered_map<const ir::Node*, std::pair<std::weak_ptr<ir::Node>, int64_t>> residents_;
  // The programs' structures the worker keeps (kPrograms, the least
  // recently run goes: the worker is told to forget it).
  static constexpr size_t kPrograms = 256;
  ir::Lru<uint64_t, char> programs_{kPrograms};
};

// A program message (Msg::Exec) as a worker reads it; its blobs are the
// bytes of the values in `keep`, in that order.
struct ProgramMessage {
  std::vector<int64_t> drop;     // kept values the worker drops (their tensors died)
  std::vector<int64_t> keep;     // values it keeps from now on, sent with it
  std::vector<uint64_t> forget;  // structures it forgets
  uint64_t key = 0;              // its structure's
  bool known = false;            // the worker keeps that structure: it is not sent
  std::string structure;
  std::vector<int64_t> reads;    // the kept values it reads
  std::string values;            // the run's values, per step
  std::string bytes() const;
};
// A program structure's head, before its steps: the device its steps run
// on, its slots and allocations, the inputs other workers send it (`npeers`
// of slot, rank, key in `peers`) and the values it tells other workers will
// not come (`nmissing` of rank, key in `missing`).
void put_structure_head(Writer& w, c10::Device device, uint32_t slots,
                        const std::vector<std::pair<int64_t, size_t>>& allocs, uint32_t npeers,
                        const std::string& peers, uint32_t nmissing, const std::string& missing);

// The error a worker sent (its class and message), to raise here.
std::exception_ptr read_error(Reader& r, std::string* message);

// The process group remote lanes use (set by configure's Python side, or
// by a C++ program); none until set.
void set_process_group(c10::intrusive_ptr<c10d::ProcessGroup> pg);
c10::intrusive_ptr<c10d::ProcessGroup> process_group();
// The connection to `rank` of the current process group (made once per
// group). Raises naming the problem: no process group, rank 0 (this
// process), a rank outside the world.
std::shared_ptr<Remote> remote(int rank);
// Tells every worker rank of the process group to stop serving.
void release_workers();

// A worker's loop: serves rank 0 of `pg` until it says bye (returns true)
// or goes away (returns false, after `why` says how).
bool serve(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::string* why = nullptr);

} // namespace torch_mgpu::runtime
