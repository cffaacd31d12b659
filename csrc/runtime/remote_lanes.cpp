// Lanes of other ranks in one execution (run.h): each lane runs as one
// program sent to its worker, its inputs sent as they are made, its end
// (statuses, times, results) taken back and bound (docs/REMOTE.md).
#include "runtime/run.h"

namespace torch_mgpu::runtime::detail {

void Run::remote_done(int i, std::vector<std::pair<int, c10::Storage>> got) {
  const ir::Node& node = *g.nodes[i];
  std::vector<c10::Storage> out;
  for (const auto& o : node.outputs) out.push_back(placeholder(o.nbytes));
  for (auto& [k, bytes] : got) {
    // (A storage may hold more than the value: a kernel's result can be
    // a view of a larger buffer, a written operand is its whole storage.)
    TORCH_CHECK(k >= 0 && k < static_cast<int>(out.size()) && bytes.nbytes() >= node.outputs[k].nbytes,
                "torch_mgpu: a worker sent back a value of the wrong size");
    out[k] = std::move(bytes);
  }
  for (const auto& o : out) ir::hold(o);
  res.values[i] = std::move(out);
  res.status[i] = Status::Ok;
  for (size_t k = 0; k < node.outputs.size(); ++k)  // what it sent other workers
    peer_bytes += static_cast<int64_t>(node.outputs[k].nbytes * forward[output_at[i] + k].size());
  release_operands(i);
}

std::string Run::build_program(RemoteLane& rl, std::vector<c10::Storage>& blobs) {
  const int l = rl.lane;
  Remote& rem = *rl.rem;
  fault_point(FaultPoint::Program, rem.name());
  ProgramMessage m;
  int64_t slots = 0;
  std::map<std::pair<const void*, int>, int64_t> input_slot;
  std::map<const void*, int64_t> resident_param;
  std::vector<std::pair<int64_t, size_t>> allocs;
  Writer peers;   // inputs other workers send: slot, rank, key
  uint32_t npeers = 0;
  Writer steps;   // the structure's steps
  Writer values;  // the run's values, per step
  steps.put<uint32_t>(static_cast<uint32_t>(rl.steps.size()));
  for (int i : rl.steps) {
    const ir::Node& node = *g.nodes[i];
    write_node(steps, values, node);
    steps.put<uint32_t>(static_cast<uint32_t>(node.operands.size()));
    for (size_t k = 0; k < node.operands.size(); ++k) {
      const ir::Value& v = node.operands[k];
      const int d = producer[operand_at[i] + k];
      int64_t ref;
      if (d >= 0 && p.lane_of[d] == l) {
        ref = remote_slot[output_at[d] + v.index];
      } else if (d < 0 && v.node->kind == ir::NodeKind::Data) {
        auto [it, first] = resident_param.try_emplace(v.node.get(), static_cast<int64_t>(m.reads.size()));
        if (first) {
          bool fresh = false;
          const int64_t id = rem.resident(v.node, fresh, m.drop);
          if (fresh) {
            m.keep.push_back(id);
            blobs.push_back(leaf(*v.node, Place()));  // its bytes in host memory
            rl.fresh.push_back(id);
          }
          m.reads.push_back(id);
        }
        ref = -1 - it->second;
      } else if (d >= 0 && forwarded_to(output_at[d] + v.index, rank_of(l))) {
        // Made on another worker, which sends it here (keyed by its
        // output's index in the graph).
        auto [it, first] = input_slot.try_emplace({g.nodes[d].get(), v.index}, slots);
        if (first) {
          peers.put<int64_t>(slots++);
          peers.put<int32_t>(rank_of(p.lane_of[d]));
          peers.put<int64_t>(output_at[d] + v.index);
          ++npeers;
        }
        ref = it->second;
      } else {
        const void* key = d >= 0 ? static_cast<const void*>(g.nodes[d].get()) : static_cast<const void*>(v.node.get());
        auto [it, first] = input_slot.try_emplace({key, v.index}, slots);
        if (first) {
          // Uninitialized bytes are allocated there, not sent.
          if (d < 0 && v.node->kind == ir::NodeKind::Empty) allocs.emplace_back(slots++, v.node->outputs[0].nbytes);
          else rl.later.push_back({slots++, v, d});
        }
        ref = it->second;
      }
      steps.put<int64_t>(ref);
      steps.put<uint8_t>(p.reuse[i][k] && ref >= 0);  // a kept value is never written in place
    }
    steps.put<uint32_t>(static_cast<uint32_t>(node.outputs.size()));
    for (size_t k = 0; k < node.outputs.size(); ++k) {
      const int out = output_at[i] + k;
      remote_slot[out] = slots;
      steps.put<int64_t>(slots++);
      steps.put<uint8_t>(exported[out]);
      steps.put<uint32_t>(static_cast<uint32_t>(forward[out].size()));
      for (int to : forward[out]) steps.put<int32_t>(to);
      if (!forward[out].empty()) steps.put<int64_t>(out);
    }
  }
  Writer structure;
  put_structure_head(structure, places[l].there, static_cast<uint32_t>(slots), allocs, npeers, peers.bytes(), 0, "");
  structure.bytes() += steps.bytes();
  m.structure = std::move(structure.bytes());
  m.key = std::hash<std::string>{}(m.structure);
  m.known = rem.knows_program(m.key, m.forget);
  counters().remote_programs++;
  if (!m.known) counters().remote_structures_sent++;
  m.values = std::move(values.bytes());
  return m.bytes();
}

std::string Run::stub_program(RemoteLane& rl) {
  Writer peers, missing;
  uint32_t npeers = 0, nmissing = 0;
  std::set<std::pair<int, int>> seen;
  for (int i : rl.steps) {
    const ir::Node& node = *g.nodes[i];
    for (size_t k = 0; k < node.operands.size(); ++k) {
      const int d = producer[operand_at[i] + k];
      if (d < 0 || !forwarded_to(output_at[d] + node.operands[k].index, rank_of(rl.lane))) continue;
      if (!seen.insert({d, node.operands[k].index}).second) continue;
      peers.put<int64_t>(npeers++);
      peers.put<int32_t>(rank_of(p.lane_of[d]));
      peers.put<int64_t>(output_at[d] + node.operands[k].index);
    }
    for (size_t k = 0; k < node.outputs.size(); ++k)
      for (int to : forward[output_at[i] + k]) {
        missing.put<int32_t>(to);
        missing.put<int64_t>(output_at[i] + k);
        ++nmissing;
      }
  }
  if (!npeers && !nmissing) return "";
  // On the worker's CPU, a slot per value it takes, no steps.
  Writer structure;
  put_structure_head(structure, c10::Device(c10::kCPU), npeers, {}, npeers, peers.bytes(), nmissing, missing.bytes());
  structure.put<uint32_t>(0);
  ProgramMessage m;
  m.structure = std::move(structure.bytes());
  m.key = std::hash<std::string>{}(m.structure);
  m.known = rl.rem->knows_program(m.key, m.forget);
  return m.bytes();
}

void Run::send_program(RemoteLane& rl) noexcept {
  std::string program;
  try {
    std::vector<c10::Storage> blobs;
    {
      std::lock_guard<std::mutex> lock(m);
      program = build_program(rl, blobs);
    }
    for (const auto& b : blobs) {
      observers().transferred(b.nbytes());
      sent_bytes += static_cast<int64_t>(b.nbytes());
    }
    {
      std::lock_guard<std::mutex> lock(m);
      rl.sent_at = now();
    }
    size_t nbytes = program.size();
    for (const auto& b : blobs) nbytes += b.nbytes();
    TransferSpan span("program_to", rl.rem->rank(), nbytes);
    rl.rem->send(Msg::Exec, program, blobs);
  } catch (const std::exception&) {
    // Not built (a node that cannot be sent): the values it would have
    // sent first are not there, and other workers that read its values,
    // or send it theirs, hear so from a program of no steps. Not sent:
    // the rank is lost.
    if (program.empty()) {
      rl.rem->unregister(rl.fresh);
      try {
        std::string stub;
        {
          std::lock_guard<std::mutex> lock(m);
          stub = stub_program(rl);
        }
        if (!stub.empty()) {
          rl.rem->send(Msg::Exec, stub, {});
          rl.stub_sent = true;
        }
      } catch (const std::exception&) {
        // The rank is lost: its peers see it gone.
      }
    } else {
      rl.rem->forget_residents();
    }
    std::lock_guard<std::mutex> lock(m);
    rl.send_failed = true;
    for (size_t s = 0; s < rl.steps.size(); ++s)
      if (!rl.reported[s] && res.status[rl.steps[s]] == Status::NotRun) {
        rl.reported[s] = 1;
        observers().node_failed();
        fail(rl.steps[s], Status::Failed, std::current_exception(), message_of_current());
      }
    rl.sent = true;
    cv.notify_all();
    return;
  }
  std::lock_guard<std::mutex> lock(m);
  rl.sent = true;
}

void Run::send_inputs(RemoteLane& rl) noexcept {
  if (rl.send_failed) return;
  for (const auto& in : rl.later) {
    c10::Storage bytes;
    std::string why;
    {
      std::unique_lock<std::mutex> lock(m);
      if (in.producer >= 0) cv.wait(lock, [&] { return res.status[in.producer] != Status::NotRun; });
      try {
        if (in.producer < 0) {
          if (in.v.node->kind == ir::NodeKind::Error) why = in.v.node->error;
          else bytes = leaf(*in.v.node, Place());
        } else if (res.status[in.producer] == Status::Ok) {
          bytes = res.values[in.producer][in.v.index];
          if (!bytes.device().is_cpu()) {
            // Queued after its producer on that lane's stream (its status
            // is set once the kernel is queued), and waited for.
            const Place& from = places[p.lane_of[in.producer]];
            std::optional<c10::StreamGuard> after;
            if (from.on_stream()) after.emplace(from.stream);
            bytes = copy_to(bytes, c10::Device(c10::kCPU), /*wait=*/true);
          }
        } else {
          why = "lost";
        }
      } catch (const std::exception& e) {
        why = message_of(e);
        bytes = c10::Storage();
      }
    }
    Writer w;
    w.put<int64_t>(in.slot);
    try {
      if (bytes) {
        observers().before_transfer();
        TransferSpan span("send_to", rl.rem->rank(), bytes.nbytes());
        rl.rem->send(Msg::Import, w.bytes(), {bytes});
        observers().transferred(bytes.nbytes());
        sent_bytes += static_cast<int64_t>(bytes.nbytes());
      } else {
        rl.rem->send(Msg::Missing, w.bytes(), {});
      }
    } catch (const std::exception&) {
      return;  // the receiving half sees the rank fail
    }
  }
}

std::string Run::message_of_current() {
  try {
    throw;
  } catch (const std::exception& e) {
    return message_of(e);
  } catch (...) {
    return "unknown error";
  }
}

Run::Spans Run::take_end(RemoteLane& rl, Reader& r, std::vector<c10::Storage>& blobs) {
  Spans spans;
  size_t nbytes = 0;
  for (const auto& b : blobs) nbytes += b.nbytes();
  TransferSpan span("receive_from", rl.rem->rank(), nbytes);
  std::lock_guard<std::mutex> lock(m);
  std::vector<uint8_t> status(rl.steps.size());
  std::vector<std::pair<double, double>> times(rl.steps.size());
  for (size_t s = 0; s < rl.steps.size(); ++s) {
    status[s] = r.get<uint8_t>();
    times[s].first = r.get<double>();
    times[s].second = r.get<double>();
  }
  // The results, each with its step and output.
  std::map<uint32_t, std::vector<std::pair<int, c10::Storage>>> results;
  for (auto& b : blobs) {
    const auto s = r.get<uint32_t>();
    const auto k = r.get<uint32_t>();
    observers().transferred(b.nbytes());
    received_bytes += static_cast<int64_t>(b.nbytes());
    results[s].emplace_back(static_cast<int>(k), std::move(b));
  }
  const bool traced = profiling();
  for (size_t s = 0; s < rl.steps.size(); ++s) {
    const int i = rl.steps[s];
    res.timing[i] = NodeTiming{rl.lane, rl.sent_at + times[s].first, rl.sent_at + times[s].second, 1};
    if (traced && status[s] == 1)
      spans.emplace_back(std::make_pair(res.timing[i].start, res.timing[i].end), std::string(g.nodes[i]->name));
    auto got = results.find(static_cast<uint32_t>(s));
    if (rl.reported[s]) {
      // Reported before (it ran and kept its outputs there, or
      // exported some): its results replace their stand-ins.
      if (got != results.end() && res.status[i] == Status::Ok) attach(i, std::move(got->second));
      continue;
    }
    if (status[s] == 1) remote_done(i, got == results.end() ? decltype(got->second)() : std::move(got->second));
    else fail(i, Status::Skipped, nullptr, "");
    rl.reported[s] = 1;
  }
  cv.notify_all();
  return spans;
}

void Run::report_remote(const RemoteLane& rl, const Spans& spans) const {
  if (spans.empty()) return;
  const double origin_us = static_cast<double>(c10::getTime()) / 1e3 - now() * 1e6;  // this run's start
  const std::string where = "rank" + std::to_string(rl.rem->rank());
  for (const auto& [t, name] : spans)
    report_span(static_cast<int64_t>(origin_us + t.first * 1e6), static_cast<int64_t>(origin_us + t.second * 1e6),
                "mgpu::" + name, where);
}

void Run::receive_remote_lane(RemoteLane& rl) noexcept {
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return rl.sent; });
    if (rl.send_failed && !rl.stub_sent) return;
  }
  if (rl.send_failed) {
    // The program of no steps sent in its place ends as any other.
    try {
      Msg kind{};
      rl.rem->receive(kind, nullptr);
      TORCH_CHECK(kind == Msg::End, "torch_mgpu: rank ", rl.rem->rank(), " answered a program of no steps with ",
                  "message kind ", static_cast<uint32_t>(kind));
    } catch (const std::exception& e) {
      rl.rem->poison(message_of(e));
    }
    return;
  }
  try {
    while (true) {
      Msg kind{};
      std::vector<c10::Storage> blobs;
      std::string body = rl.rem->receive(kind, &blobs);
      Reader r(body);
      if (kind == Msg::End) {
        report_remote(rl, take_end(rl, r, blobs));
        return;
      }
      const auto s = r.get<uint32_t>();
      TORCH_CHECK(s < rl.steps.size(), "torch_mgpu: rank ", rl.rem->rank(), " reported step ", s, " of ",
                  rl.steps.size());
      const int i = rl.steps[s];
      std::lock_guard<std::mutex> lock(m);
      // Steps before it that reported nothing ran (a failed or skipped
      // step says so at once) and keep their outputs there.
      for (; rl.cursor < s; ++rl.cursor)
        if (!rl.reported[rl.cursor]) {
          remote_done(rl.steps[rl.cursor], {});
          rl.reported[rl.cursor] = 1;
        }
      if (kind == Msg::Skipped) {
        fail(i, Status::Skipped, nullptr, "");
      } else if (kind == Msg::Export) {
        size_t nbytes = 0;
        for (const auto& b : blobs) nbytes += b.nbytes();
        TransferSpan span("receive_from", rl.rem->rank(), nbytes);
        std::vector<std::pair<int, c10::Storage>> got;
        for (auto& b : blobs) {
          observers().transferred(b.nbytes());
          received_bytes += static_cast<int64_t>(b.nbytes());
          got.emplace_back(static_cast<int>(r.get<uint32_t>()), std::move(b));
        }
        remote_done(i, std::move(got));
      } else {
        TORCH_CHECK(kind == Msg::Failed, "torch_mgpu: rank ", rl.rem->rank(), " sent message kind ",
                    static_cast<uint32_t>(kind), " during a run");
        std::string msg;
        auto e = read_error(r, &msg);
        observers().node_failed();
        fail(i, Status::Failed, e, msg);
      }
      rl.reported[s] = 1;
      cv.notify_all();
    }
  } catch (const std::exception& e) {
    // A message that could not be taken leaves the connection out of step
    // (a late answer would be read by the next run): the rank is lost.
    rl.rem->poison(message_of(e));
    std::lock_guard<std::mutex> lock(m);
    for (size_t s = 0; s < rl.steps.size(); ++s)
      if (res.status[rl.steps[s]] == Status::NotRun) {
        rl.reported[s] = 1;
        observers().node_failed();
        fail(rl.steps[s], Status::Failed, std::current_exception(), message_of_current());
      }
    cv.notify_all();
  }
}

void Run::attach(int i, std::vector<std::pair<int, c10::Storage>> got) {
  auto& vals = res.values[i];
  for (auto& [k, bytes] : got) {
    TORCH_CHECK(k >= 0 && k < static_cast<int>(vals.size()) && bytes.nbytes() >= g.nodes[i]->outputs[k].nbytes,
                "torch_mgpu: a worker sent back a value of the wrong size");
    if (!is_stand_in(vals[k])) continue;
    ir::release(vals[k]);
    vals[k] = std::move(bytes);
    ir::hold(vals[k]);
  }
}

void Run::finish_remote() {
  // With no failure only the results matter, and they came back with
  // each program's end: the rest was freed there.
  const bool failed = static_cast<bool>(res.first_error);
  for (const auto& rl : remote_lanes) {
    for (int i : rl->steps) {
      auto& vals = res.values[i];
      for (size_t k = 0; k < vals.size(); ++k) {
        if (!is_stand_in(vals[k])) continue;
        c10::Storage got;
        if (failed && res.status[i] == Status::Ok) {
          try {
            observers().before_transfer();
            TransferSpan span("fetch_from", rl->rem->rank(), vals[k].nbytes());
            got = rl->rem->get(remote_slot[output_at[i] + k], vals[k].nbytes());
            observers().transferred(got.nbytes());
            received_bytes += static_cast<int64_t>(got.nbytes());
          } catch (const std::exception& e) {
            // A value the worker freed after its last use (its readers
            // ran before the failure) is needed by nothing; one on a lost
            // rank is lost with it.
            if (rl->rem->lost()) {
              observers().node_failed();
              fail(i, Status::Failed, std::current_exception(), message_of(e));
            }
          }
        }
        ir::release(vals[k]);
        vals[k] = got;
        if (got) ir::hold(got);
      }
      if (res.status[i] != Status::Ok)
        for (auto& v : vals) {
          if (v) ir::release(v);
          v = c10::Storage();
        }
    }
    if (!failed) continue;
    try {
      rl->rem->free({});  // the slots it kept for these reads
    } catch (const std::exception&) {
      // A lost rank keeps nothing.
    }
  }
}

} // namespace torch_mgpu::runtime::detail
