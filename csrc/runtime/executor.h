#pragma once
// Runs a Plan over a Graph. A node's operands arrive as CPU storages (the
// bytes of each value it reads); its outputs leave as storages. A node that
// raises fails alone: nodes that need its results are skipped, the rest run.
#include "ir/graph.h"
#include "ir/view.h"
#include "plan/plan.h"
#include "runtime/place.h"
#include "runtime/run_node.h"

#include <ATen/ATen.h>

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace torch_mgpu::runtime {

enum class Status : uint8_t { NotRun, Ok, Failed, Skipped };

struct NodeTiming {
  int lane = 0;
  double start = 0, end = 0;  // seconds from the start of execution
  int threads = 1;            // intra-op threads it ran with
};

struct ExecResult {
  // values[i][k]: bytes of output k of node i, while alive (roots and the
  // values a failed node did not get to consume stay alive). Each is held
  // (ir/held_bytes.h) until freed or until the result dies.
  std::vector<std::vector<c10::Storage>> values;
  std::vector<Status> status;
  std::vector<NodeTiming> timing;
  std::exception_ptr first_error;
  std::string first_message;
  // Failed nodes: each one's own error message (its op and caller named).
  std::unordered_map<int, std::string> messages;
  double makespan = 0;
  // Lanes on other ranks: bytes of values sent to workers (inputs, kept
  // values the first time) and received from them.
  int64_t remote_bytes_sent = 0, remote_bytes_received = 0;
  int64_t remote_bytes_between_workers = 0;  // values one worker sent another
  std::chrono::steady_clock::time_point started;  // timing[i] counts from here

  ExecResult() = default;
  ExecResult(ExecResult&& o) noexcept;
  ExecResult& operator=(ExecResult&& o) noexcept;
  ExecResult(const ExecResult&) = delete;
  ExecResult& operator=(const ExecResult&) = delete;
  ~ExecResult();

 private:
  void drop_values();
};

// Nodes that run as one call on their lane in place of a call each (a
// compiled part of a hot graph, engine/tier_run.cpp). The executor treats
// a part as it treats a node: it waits for what the part reads (the host
// order; on a stream lane, the events of the other lanes' producers), hands
// the call the bytes of the values it reads from outside it, records their
// use on the lane's stream, reports the accesses to the observers, and
// records the events and end times of the part's nodes after it. A part
// that raises fails each of its nodes; one whose input is missing is
// skipped. Of the part's outputs only those in `makes` get bytes.
struct Part {
  std::vector<int> nodes;  // consecutive in their lane's order
  // The values it reads from outside, in the call's order, each with the
  // graph node that makes it (-1: a leaf).
  std::vector<std::pair<ir::Value, int>> reads;
  std::vector<std::pair<int, int>> makes;  // (node, output) the call returns, in order
  std::string name;                        // in the sanitizer's reports
  // The bytes of `makes`, from the bytes of `reads`, run where `place`
  // says (its stream current); also the blocks the work wrote.
  std::function<std::vector<c10::Storage>(const std::vector<c10::Storage>& reads, const Place& place,
                                          std::vector<const void*>& written)>
      call;
};

struct Parts {
  std::vector<Part> parts;
  std::vector<int> part_at;  // per node: the part it starts, -1 otherwise
  std::vector<int> part_of;  // per node: its part, -1 when it runs alone
};

struct Recording;

// Runs plan `p` with `places[l]` the place of lane l (see place.h), and
// `parts` (if any) each as one call. With `recording`, what the lanes queue
// is recorded into it for replay() (replay.h), or the reason it cannot be.
ExecResult execute(const ir::Graph& g, const plan::Plan& p, const std::vector<Place>& places,
                   const Parts* parts = nullptr, Recording* recording = nullptr);

// Whether a node of this name may reach a factorization whose CUDA kernels
// PyTorch loads on first use (execute() loads them once beforehand on CUDA
// lanes: two threads loading them at once fail).
bool may_load_cuda_linalg(std::string_view name);

} // namespace torch_mgpu::runtime
