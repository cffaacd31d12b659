// Tier 1: a run of compiled code on the lanes: the leaves' bytes, each part
// on its lane after the parts it reads, values between them, and the
// outputs bound as the graph's values (docs/TIERS.md).
#include "engine/tier1.h"

namespace torch_mgpu::engine::tier1 {

// A leaf's bytes on `device` (a copy there is complete on return: every
// lane's stream may read it).
c10::Storage leaf_bytes(const ir::Value& v, c10::Device device) {
  const auto& n = *v.node;
  if (n.kind == ir::NodeKind::Data && n.data.device() == device) return n.data;
  const size_t nbytes = n.kind == ir::NodeKind::Data ? n.data.nbytes() : n.outputs.at(v.index).nbytes;
  return n.replica_or(device, [&](const c10::Storage* any) {
    if (n.kind == ir::NodeKind::Data) return runtime::copy_to(n.data, device, /*wait=*/true);
    return any ? runtime::copy_to(*any, device, /*wait=*/true) : runtime::allocate(nbytes, device);
  });
}

// One run of a compiled graph: every value's bytes by number, as the parts
// make them.
struct Values {
  const ir::Graph& g;
  const Numbering& nb;
  const std::vector<runtime::Place>& places;  // by lane
  std::vector<c10::Storage> bytes;
  std::mutex m;
  std::unordered_set<const void*> taken;  // storages some value owns
  // Stream lanes: an event after each part, on its lane's stream; a part
  // on another lane waits on it before its own work (set before the part
  // counts as done, read after).
  std::vector<std::optional<c10::Event>> events;

  // Runs part `p` of `c`: reads its leaves' bytes, stores its roots'. On a
  // stream lane (its stream current), the part's work is queued after the
  // events of the parts on other lanes it reads, and an event follows it.
  // No block it reads is freed before every lane's stream has finished (the
  // values between parts live until call() returns, after the lanes'
  // synchronizes), so none needs recording on another stream.
  void run(const CompiledGraph& c, size_t p) {
    const CompiledPart& part = c.parts[p];
    const CompiledGraph::Layout& lay = c.layout[p];
    const runtime::Place& place = places.at(static_cast<size_t>(lay.lane));
    if (place.streams)
      for (int d : lay.after)
        if (c.layout[static_cast<size_t>(d)].lane != lay.lane && events[static_cast<size_t>(d)]) {
          runtime::observers().before_event_wait();
          if (!runtime::observers().drops_event_wait()) events[static_cast<size_t>(d)]->block(place.stream);
        }
    std::vector<at::Tensor> inputs;
    std::unordered_set<const void*> input_bytes;
    for (size_t k = 0; k < lay.leaves.size(); ++k) {
      const int w = lay.leaves[k];
      const c10::Storage& s = bytes.at(static_cast<size_t>(w));
      TORCH_CHECK(static_cast<bool>(s), "mgpu: a compiled part ran before the value it reads");
      // A value made here is read at its own size (its storage may be larger).
      size_t nbytes = s.nbytes();
      if (w >= static_cast<int>(nb.leaves.size())) {
        const auto [i, o] = nb.outputs[static_cast<size_t>(w) - nb.leaves.size()];
        nbytes = g.nodes[static_cast<size_t>(i)]->outputs.at(static_cast<size_t>(o)).nbytes;
      }
      const auto dtype = part.input_dtypes[k];
      const int64_t numel = static_cast<int64_t>(nbytes / c10::elementSize(dtype));
      inputs.push_back(at::empty({0}, at::TensorOptions().dtype(dtype).device(s.device())).set_(s, 0, {numel}, {1}));
      input_bytes.insert(s.data());
    }
    for (const auto& [i, k] : lay.lifted)
      inputs.push_back(lifted_input(g.nodes.at(i)->args.at(k).constant, place.device));
    std::vector<at::Tensor> outs = part.run(inputs);
    std::vector<const void*> written;  // the part's work on its stream writes these
    TORCH_CHECK(outs.size() == lay.roots.size(), "mgpu: a compiled graph returned ", outs.size(),
                " tensors, expected ", lay.roots.size());
    for (size_t j = 0; j < outs.size(); ++j) {
      const int w = lay.roots[j];
      const auto [i, k] = nb.outputs.at(static_cast<size_t>(w) - nb.leaves.size());
      const ir::Output& o = g.nodes[static_cast<size_t>(i)]->outputs.at(static_cast<size_t>(k));
      const at::Tensor& t = outs[j];
      ir::TensorGeometry geom = o.geom;
      if (o.mutated_operand >= 0) {  // the storage's bytes, flat
        geom = ir::TensorGeometry();
        geom.dtype = t.scalar_type();
        geom.sizes = {static_cast<int64_t>(o.nbytes / t.element_size())};
        geom.strides = {1};
      }
      c10::Storage s;
      // A ZeroTensor (inductor returns autograd's `_efficientzerotensor` as
      // one) has no bytes behind its storage: its value is copied (zeros).
      const bool has_bytes = t.defined() && t.layout() == at::kStrided && !t._is_zerotensor() &&
          (t.storage().nbytes() == 0 || t.storage().data() != nullptr);
      if (has_bytes) written.push_back(t.storage().data());
      bool own = has_bytes && t.device() == place.device &&
          capture::geometry_of(t) == geom && t.storage().nbytes() >= o.nbytes && !input_bytes.count(t.storage().data());
      if (own) {
        std::lock_guard<std::mutex> lock(m);
        own = taken.insert(t.storage().data()).second;
      }
      if (own) {
        s = t.storage();
      } else {
        TORCH_CHECK(t.defined() && t.numel() * t.element_size() <= static_cast<int64_t>(o.nbytes),
                    "mgpu: a compiled graph returned a tensor that does not fit its value");
        s = runtime::allocate(o.nbytes, place.device);
        runtime::view(s, geom).copy_(t);
        written.push_back(s.data());
      }
      bytes[static_cast<size_t>(w)] = std::move(s);
    }
    if (!place.streams) return;
    if (runtime::observers().watches_streams()) {
      std::vector<const void*> read(input_bytes.begin(), input_bytes.end());
      runtime::observers().stream_access(place.device,
                                         "compiled part " + std::to_string(p) + " (from node " +
                                             std::to_string(g.nodes.at(static_cast<size_t>(lay.nodes.at(0)))->id) + ")",
                                         read, written, false);
    }
    events[p].emplace(place.device.type());
    events[p]->record(place.stream);
  }
};

// Runs `c` on `g`'s leaves; the roots' bytes in an ExecResult as tier 0
// would leave them. Throws when the compiled code does (nothing written:
// compiled code writes no input). A split graph runs its parts on the
// lanes, each lane its parts in order, each part once the parts it reads
// from are done; `threads`: the intra-op threads of each lane.
runtime::ExecResult call(const ir::Graph& g, const CompiledGraph& c, const std::vector<runtime::Place>& places,
                         int threads) {
  const Numbering nb = number(g);
  TORCH_CHECK(c.layout.size() == c.parts.size() && !c.parts.empty(), "mgpu: a compiled graph without its layout");
  TORCH_CHECK(!places.empty(), "mgpu: a compiled graph without lanes");
  for (const auto& lay : c.layout)
    TORCH_CHECK(lay.lane >= 0 && static_cast<size_t>(lay.lane) < places.size(), "mgpu: a compiled part on a lane the graph does not have");
  const bool streams = places[0].streams;
  Values vals{g, nb, places, std::vector<c10::Storage>(static_cast<size_t>(nb.count())), {}, {}, {}};
  vals.events.resize(c.parts.size());
  for (size_t k = 0; k < nb.leaves.size(); ++k) vals.bytes[k] = leaf_bytes(nb.leaves[k], places[0].device);
  for (const auto& lay : c.layout)
    for (int w : lay.leaves)
      TORCH_CHECK(w >= 0 && w < nb.count(), "mgpu: a compiled graph reads a value the graph does not have");
  runtime::ExecResult r;
  const size_t n = g.size();
  r.values.resize(n);
  r.status.assign(n, runtime::Status::Ok);
  r.timing.assign(n, runtime::NodeTiming{0, 0.0, 0.0, 1});
  r.started = std::chrono::steady_clock::now();
  auto since = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - r.started).count(); };
  std::vector<std::pair<double, double>> spans(c.parts.size());
  if (c.parts.size() == 1 && !streams) {
    vals.run(c, 0);
    spans[0] = {0.0, since()};
  } else {
    // Each lane's parts, in order; done[p]: 1 once part p's roots are stored.
    std::vector<int> slots;
    for (const auto& lay : c.layout)
      if (std::find(slots.begin(), slots.end(), lay.lane) == slots.end()) slots.push_back(lay.lane);
    std::vector<char> done(c.parts.size(), 0);
    bool failed = false;
    std::exception_ptr error;
    std::mutex m;
    std::condition_variable cv;
    at::ThreadLocalState tls;
    std::vector<std::function<void()>> jobs;
    // A lane's failure (the first one is raised): the others stop before
    // their next part.
    const std::function<void(std::exception_ptr)> fail = [&](std::exception_ptr e) {
      std::lock_guard<std::mutex> lock(m);
      if (!error) error = std::move(e);
      failed = true;
      cv.notify_all();
    };
    for (int lane : slots)
      jobs.emplace_back([&, lane] {
        at::ThreadLocalStateGuard guard(tls);
        // A stream lane queues its parts on its stream, then waits for it
        // (whether or not a part failed: nothing it queued may outlive
        // the run).
        const runtime::Place& place = places[static_cast<size_t>(lane)];
        std::optional<c10::StreamGuard> on_stream;
        try {
          if (place.streams) on_stream.emplace(place.stream);
        } catch (...) {  // a device in error: the run fails, nothing was queued
          fail(std::current_exception());
          return;
        }
        struct Drain {
          const runtime::Place& place;
          const std::function<void(std::exception_ptr)>& fail;
          ~Drain() {
            if (!place.streams) return;
            try {
              runtime::observers().before_stream_sync();
              place.stream.synchronize();
              runtime::observers().lane_done();
            } catch (...) {
              fail(std::current_exception());
            }
          }
        } drain{place, fail};
        for (size_t p = 0; p < c.parts.size(); ++p) {
          if (c.layout[p].lane != lane) continue;
          {
            std::unique_lock<std::mutex> lock(m);
            cv.wait(lock, [&] {
              if (failed) return true;
              for (int d : c.layout[p].after)
                if (!done[static_cast<size_t>(d)]) return false;
              return true;
            });
            if (failed) return;
          }
          const double start = since();
          try {
            vals.run(c, p);
          } catch (...) {
            fail(std::current_exception());
            return;
          }
          std::lock_guard<std::mutex> lock(m);
          spans[p] = {start, since()};
          done[p] = 1;
          cv.notify_all();
        }
      });
    {
      // The parts take the interpreter lock to be called: the lanes must
      // not wait for it while this thread holds it.
      capture::InterpreterRelease unlocked;
      runtime::LanePool::instance().run(jobs, threads);
    }
    if (streams && runtime::observers().watches_streams()) {
      // The lanes are joined: the host reads the roots from here on.
      std::vector<std::pair<const void*, std::string>> results;
      for (int w : nb.roots)
        if (vals.bytes.at(static_cast<size_t>(w))) results.emplace_back(vals.bytes[static_cast<size_t>(w)].data(), "a result of a compiled graph");
      runtime::observers().run_done(results);
    }
    if (error) std::rethrow_exception(error);
  }
  const double seconds = since();
  runtime::counters().tier1_call_us += static_cast<int64_t>(seconds * 1e6);
  for (size_t j = 0; j < nb.roots.size(); ++j) {
    const auto [i, k] = nb.root_outputs[j];
    c10::Storage s = vals.bytes.at(static_cast<size_t>(nb.roots[j]));
    TORCH_CHECK(static_cast<bool>(s), "mgpu: a compiled graph did not return a result the sync needs");
    ir::hold(s);
    r.values[static_cast<size_t>(i)].resize(g.nodes[static_cast<size_t>(i)]->outputs.size());
    r.values[static_cast<size_t>(i)][static_cast<size_t>(k)] = std::move(s);
  }
  for (size_t p = 0; p < c.parts.size(); ++p)
    for (int i : c.layout[p].nodes)
      r.timing[static_cast<size_t>(i)] = runtime::NodeTiming{c.layout[p].lane, spans[p].first, spans[p].second, threads};
  r.makespan = seconds;
  return r;
}

} // namespace torch_mgpu::engine::tier1
