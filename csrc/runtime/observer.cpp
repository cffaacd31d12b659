#include "runtime/observer.h"
#include "runtime/counters.h"
#include "runtime/faults.h"
#include "runtime/sanitizer.h"

#include <array>

namespace torch_mgpu::runtime {
namespace {

struct Faults final : ExecutionObserver {
  void before_node(const ir::Node& n) override { fault_point(FaultPoint::Node, n.name); }
  void before_transfer() override { fault_point(FaultPoint::Transfer); }
  void before_event_wait() override { fault_point(FaultPoint::EventWait); }
  void before_stream_sync() override { fault_point(FaultPoint::StreamSync); }
  bool drops_event_wait() override { return fault_drops(FaultPoint::DropEventWait); }
  bool drops_record_use() override { return fault_drops(FaultPoint::DropRecordUse); }
};

struct Sanitizer final : ExecutionObserver {
  bool watches_streams() override { return stream_sanitizer_on(); }
  void stream_access(c10::Device device, const std::string& what, const std::vector<const void*>& reads,
                     const std::vector<const void*>& writes, bool synchronous) override {
    report_stream_access(device, what, reads, writes, synchronous);
  }
  void lane_done() override { report_lane_done(); }
  void run_done(const std::vector<std::pair<const void*, std::string>>& results) override {
    report_run_done();
    for (const auto& [buffer, what] : results) report_host_read(buffer, what);
  }
};

struct Counting final : ExecutionObserver {
  void transferred(size_t bytes) override { counters().bytes_transferred += static_cast<int64_t>(bytes); }
  void nodes_ran(int64_t count) override { counters().ops_executed += count; }
  void node_failed() override { counters().execution_errors++; }
};

// Forwards each report to the observers in order.
struct All final : ExecutionObserver {
  Faults faults;
  Sanitizer sanitizer;
  Counting counting;
  std::array<ExecutionObserver*, 3> each{&faults, &sanitizer, &counting};

  void before_node(const ir::Node& n) override {
    for (auto* o : each) o->before_node(n);
  }
  void before_transfer() override {
    for (auto* o : each) o->before_transfer();
  }
  void before_event_wait() override {
    for (auto* o : each) o->before_event_wait();
  }
  void before_stream_sync() override {
    for (auto* o : each) o->before_stream_sync();
  }
  bool watches_streams() override {
    bool any = false;
    for (auto* o : each) any = o->watches_streams() || any;
    return any;
  }
  bool drops_event_wait() override {
    bool drop = false;
    for (auto* o : each) drop = o->drops_event_wait() || drop;
    return drop;
  }
  bool drops_record_use() override {
    bool drop = false;
    for (auto* o : each) drop = o->drops_record_use() || drop;
    return drop;
  }
  void stream_access(c10::Device device, const std::string& what, const std::vector<const void*>& reads,
                     const std::vector<const void*>& writes, bool synchronous) override {
    for (auto* o : each) o->stream_access(device, what, reads, writes, synchronous);
  }
  void lane_done() override {
    for (auto* o : each) o->lane_done();
  }
  void run_done(const std::vector<std::pair<const void*, std::string>>& results) override {
    for (auto* o : each) o->run_done(results);
  }
  void transferred(size_t bytes) override {
    for (auto* o : each) o->transferred(bytes);
  }
  void nodes_ran(int64_t count) override {
    for (auto* o : each) o->nodes_ran(count);
  }
  void node_failed() override {
    for (auto* o : each) o->node_failed();
  }
};

} // namespace

ExecutionObserver& observers() {
  static auto* all = new All();  // leaked: lanes may report during exit
  return *all;
}

} // namespace torch_mgpu::runtime
