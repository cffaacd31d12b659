// A worker rank's side of remote lanes: the values it keeps between runs,
// the programs it runs (their steps on its lanes, values sent straight to
// other workers), and serve(), its loop until the controller lets it go.
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

  // The program a request names (its structure read where it comes with
  // it), with this run's values patched into its steps; first the kept
  // values the request drops and adds, and the programs it forgets.
  Program& program_of(Reader& r, std::vector<c10::Storage>& blobs) {
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
    return prog;
  }

  // One run of a program here: where its steps run, its slots and where
  // each one's value is, and what End reports.
  struct ProgramRun {
    enum : char { Absent, Present, Lost };
    Worker& wk;
    const Program& prog;
    Place here;
    std::optional<c10::DeviceGuard> on_device;
    std::vector<char> state;  // per slot
    // Inputs other workers send: by (rank, key), each rank's in the order
    // it sends them. A rank that goes away loses what it had to send.
    std::vector<int> peer_of;
    std::map<std::pair<int, int64_t>, int64_t> peer_slot;
    // Each slot's last reader: it is freed after it, unless it is a result
    // (sent with End). A failure keeps every slot, for the reads the
    // controller then makes.
    std::vector<int64_t> last_use;
    std::vector<char> result;
    bool any_failed = false;
    std::vector<c10::Storage> results;
    Writer result_ids, end;
    std::chrono::steady_clock::time_point t0;

    // Where the steps run: this rank's CPU, or one of its CUDA devices (each
    // step on the device's current stream, waited for after it: a step's
    // error and times are its own).
    ProgramRun(Worker& w, const Program& p) : wk(w), prog(p) {
      here.device = prog.device;
      if (!prog.device.is_cpu()) {
        on_device.emplace(prog.device);
        here.stream = c10::impl::VirtualGuardImpl(prog.device.type()).getStream(prog.device);
        here.kind = LaneKind::Stream;
      }
      auto& slots = wk.slots;
      slots.assign(prog.slots, c10::Storage());
      state.assign(slots.size(), Absent);
      for (auto [slot, nbytes] : prog.allocs) {
        slots[slot] = prog.device.is_cpu() ? allocate(nbytes) : placeholder(nbytes);
        state[slot] = Present;
      }
      t0 = std::chrono::steady_clock::now();
      peer_of.assign(slots.size(), -1);
      for (const auto& in : prog.from_peers) {
        peer_of[in.slot] = in.peer;
        peer_slot[{in.peer, in.key}] = in.slot;
      }
      last_use.assign(slots.size(), -1);
      result.assign(slots.size(), 0);
      for (size_t s = 0; s < prog.steps.size(); ++s) {
        for (auto ref : prog.steps[s].refs)
          if (ref >= 0) last_use[ref] = static_cast<int64_t>(s);
        for (size_t k = 0; k < prog.steps[s].outs.size(); ++k)
          if (prog.steps[s].exported[k] == 2) result[prog.steps[s].outs[k]] = 1;
      }
    }

    double now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }

    // The next value worker `peer` sends this program.
    void next_from_peer(int peer) {
      auto& slots = wk.slots;
      try {
        TORCH_CHECK(!wk.distrusted.count(peer), "torch_mgpu: rank ", peer, " was lost before");
        Msg kind{};
        std::vector<c10::Storage> got;
        std::string body = receive_message(*wk.backend, peer, kToPeer, kind, &got, timeout());
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
        wk.distrusted.insert(peer);
        for (size_t k = 0; k < slots.size(); ++k)
          if (peer_of[k] == peer && state[k] == Absent) state[k] = Lost;
      }
    }

    // The controller's next input of this run.
    void next_input() {
      auto& slots = wk.slots;
      Msg kind{};
      std::vector<c10::Storage> got;
      // As long as the controller's lanes take: its death closes the connection.
      std::string body = receive_message(*wk.backend, 0, kToWorker, kind, &got, forever());
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
    }

    // Where step `st`'s operands are kept (a run's slot, or a value kept
    // from run to run), each waited for; `status` 3 if one was lost.
    // Every input the controller sends is taken, even for a step that will
    // not run: what is left unread would be taken as the next request.
    std::vector<c10::Storage*> operands_of(const Step& st, uint8_t& status) {
      std::vector<c10::Storage*> where;
      size_t kept = 0;
      for (auto ref : st.refs) {
        if (ref >= 0) {
          while (state[ref] == Absent) peer_of[ref] >= 0 ? next_from_peer(peer_of[ref]) : next_input();
          if (state[ref] == Lost) status = 3;
          else where.push_back(&wk.slots[ref]);
        } else {
          where.push_back(&wk.value(-st.kept[kept++]));
        }
      }
      return where;
    }

    // Runs step s on its operands (moved to the device first: a copy there
    // that fails, such as one out of memory, fails the step); its exported
    // outputs go back now, its results with End. Returns the outputs other
    // workers read, in host memory (a copy that fails fails the step); on
    // failure `status` 2, and the error goes back.
    std::vector<c10::Storage> run(size_t s, const std::vector<c10::Storage*>& where, std::vector<c10::Storage> operands,
                                  uint8_t& status) {
      const Step& st = prog.steps[s];
      std::vector<c10::Storage> forwarded;
      try {
        for (size_t k = 0; k < where.size(); ++k) operands[k] = on(*where[k], prog.device);
        std::vector<c10::Storage> out;
        {
          ir::CallStateGuard settings(st.node->state);
          out = run_node(*st.node, std::move(operands), st.reuse, here);
          if (here.on_stream()) here.stream.synchronize();
        }
        forwarded.assign(out.size(), c10::Storage());
        for (size_t k = 0; k < out.size(); ++k)
          if (!st.forward[k].empty()) forwarded[k] = host(out[k]);
        std::vector<c10::Storage> sent;
        Writer w;
        w.put<uint32_t>(static_cast<uint32_t>(s));
        for (size_t k = 0; k < out.size(); ++k) {
          wk.slots[st.outs[k]] = out[k];
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
        if (!sent.empty()) send_message(*wk.backend, 0, kToController, Msg::Export, w.bytes(), sent, &wk.pending);
      } catch (const c10::DistError&) {
        throw;  // the connection, not the op
      } catch (const std::exception& e) {
        status = 2;
        Writer w;
        w.put<uint32_t>(static_cast<uint32_t>(s));
        write_error(w, e);
        wk.answer(Msg::Failed, w.bytes(), {});
      }
      return forwarded;
    }

    // Step s: its operands, its run, its outputs to other workers (a
    // failed step's: word that they will not come), its slots freed after
    // their last use, its status and times for End.
    void step(size_t s) {
      const Step& st = prog.steps[s];
      uint8_t status = 1;  // 1 ran, 2 failed, 3 skipped (an input was lost)
      const std::vector<c10::Storage*> where = operands_of(st, status);
      std::vector<c10::Storage> operands;
      for (auto* w : where) operands.push_back(*w);
      if (status == 1) check_views(st, operands);
      const double start = now();  // its inputs are here
      std::vector<c10::Storage> forwarded;
      if (status == 1) forwarded = run(s, where, std::move(operands), status);
      for (size_t k = 0; k < st.outs.size(); ++k)
        for (int peer : st.forward[k])
          status == 1 ? wk.send_to_peer(peer, Msg::Import, st.keys[k], {forwarded[k]})
                      : wk.send_to_peer(peer, Msg::Missing, st.keys[k], {});
      if (status == 3) {
        Writer w;
        w.put<uint32_t>(static_cast<uint32_t>(s));
        wk.answer(Msg::Skipped, w.bytes(), {});
      }
      if (status != 1) {
        any_failed = true;
        for (auto o : st.outs) state[o] = Lost;
      }
      if (!any_failed) {
        for (auto ref : st.refs)
          if (ref >= 0 && last_use[ref] == static_cast<int64_t>(s) && !result[ref]) wk.slots[ref] = c10::Storage();
        for (auto o : st.outs)
          if (last_use[o] < 0 && !result[o]) wk.slots[o] = c10::Storage();
      }
      end.put<uint8_t>(status);
      end.put<double>(start);
      end.put<double>(now());
    }

    // Every value other workers send this program is taken (a program of
    // no steps takes them here); then End, with the results.
    void finish() {
      for (size_t k = 0; k < wk.slots.size(); ++k)
        while (peer_of[k] >= 0 && state[k] == Absent) next_from_peer(peer_of[k]);
      end.bytes() += result_ids.bytes();
      wk.answer(Msg::End, end.bytes(), results);
      wk.reap_peer_sends();
      if (!any_failed) wk.slots.clear();
    }
  };

  // A lane's program: its inputs come with it or after it (Import /
  // Missing, in the order its steps need them); each step's exported
  // outputs go back as soon as it has run, and its error if it fails; End
  // gives every step's status and times, and the results.
  void exec(Reader& r, std::vector<c10::Storage>& blobs) {
    const Program& prog = program_of(r, blobs);
    ProgramRun run(*this, prog);
    // A program that could not be built here: the values it would have
    // sent other workers will not come.
    for (auto [peer, k] : prog.missing) send_to_peer(peer, Msg::Missing, k, {});
    for (size_t s = 0; s < prog.steps.size(); ++s) run.step(s);
    run.finish();
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
