#include "ir/env.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace torch_mgpu::ir::env {

namespace {
VarInfo row(Var v, const char* name, const char* fallback, const char* meaning, Kind kind = Kind::Text, int64_t min = 0,
            const char* unit = "", std::vector<std::string> choices = {}) {
  return VarInfo{v, name, fallback, meaning, kind, min, unit, std::move(choices)};
}
} // namespace

const std::vector<VarInfo>& table() {
  static const std::vector<VarInfo> t = {
      row(Var::Devices, "TORCH_MGPU_DEVICES", "every CUDA device, else cpu",
       "the physical devices, comma-separated (cpu, cuda:0, ...; a repeat is another virtual device)"),
      row(Var::Lanes, "TORCH_MGPU_LANES", "per device: 4 CUDA streams, or the cores shared out on the CPU",
       "lanes per device", Kind::Integer, 1),
      row(Var::Policy, "TORCH_MGPU_POLICY", "auto", "the scheduling policy: auto, heft or serial", Kind::Choice, 0, "", {"auto", "heft", "serial"}),
      row(Var::Sync, "TORCH_MGPU_SYNC", "graph", "op runs each op at its call (every error at its call); graph records", Kind::Choice, 0, "", {"graph", "op"}),
      row(Var::AsyncOps, "TORCH_MGPU_ASYNC_OPS", "256",
       "ops recorded before a background flight starts; 0 turns background flights off", Kind::Integer, 0),
      row(Var::MaxPending, "TORCH_MGPU_MAX_PENDING", "100000", "pending ops that force a sync", Kind::Integer, 1),
      row(Var::Compile, "TORCH_MGPU_COMPILE", "2 (on)",
       "tier 1: the syncs of one graph before it is compiled (on = 2; off = 0: results bitwise eager's)", Kind::Tiers, 0),
      row(Var::CompileChoice, "TORCH_MGPU_COMPILE_CHOICE", "measure",
       "the compile backend's choice between partitions and whole: measure, partitions or whole", Kind::Choice, 0, "", {"measure", "partitions", "whole"}),
      row(Var::AtCall, "TORCH_MGPU_AT_CALL", "auto",
       "ops of a repeated trace run at their call (as eager) where that measures faster: auto, on (always, on host lanes) or off", Kind::Choice, 0, "", {"auto", "on", "off"}),
      row(Var::Refine, "TORCH_MGPU_REFINE", "1", "0 turns off refining plans by measured node times", Kind::Switch),
      row(Var::Fusion, "TORCH_MGPU_FUSION", "1", "0 turns off fusing elementwise chains", Kind::Switch),
      row(Var::Caller, "TORCH_MGPU_CALLER", "1", "0 leaves the caller's file:line out of nodes and errors", Kind::Switch),
      row(Var::SpinUs, "TORCH_MGPU_SPIN_US", "300", "microseconds an idle lane or the background worker spins before sleeping", Kind::Integer, 0),
      row(Var::HostCacheMb, "TORCH_MGPU_HOST_CACHE_MB", "1024", "MiB of large host blocks kept for reuse; 0 = off", Kind::Integer, 0),
      row(Var::FullProbeNumel, "TORCH_MGPU_FULL_PROBE_NUMEL", "16384",
       "elements up to which a call is checked on its whole inputs on the CPU (above: a cut of 2 per dim)", Kind::Integer, 0),
      row(Var::NoCalibration, "TORCH_MGPU_NO_CALIBRATION", "unset",
       "set (to anything): the default cost model, nothing measured", Kind::Switch),
      row(Var::NetworkGbps, "TORCH_MGPU_NETWORK_GBPS", "measured", "the network's bandwidth to remote ranks, GB/s", Kind::Number, 0, "GB/s"),
      row(Var::NetworkLatencyUs, "TORCH_MGPU_NETWORK_LATENCY_US", "measured",
       "the network's latency to remote ranks, microseconds", Kind::Number, 0, "us"),
      row(Var::RemoteTimeout, "TORCH_MGPU_REMOTE_TIMEOUT", "3600", "seconds before a remote rank is given up", Kind::Number, 0, "seconds"),
      row(Var::WorkerThreads, "TORCH_MGPU_WORKER_THREADS", "torch's default", "intra-op threads of a worker rank", Kind::Integer, 1),
      row(Var::WireVersion, "TORCH_MGPU_WIRE_VERSION", "this build's",
       "tests: the wire version a worker claims (a mismatched worker)"),
      row(Var::Fault, "TORCH_MGPU_FAULT", "unset",
       "tests: point:n fails the n-th node, transfer, event_wait, stream_sync, ... (see README)"),
  };
  return t;
}

const VarInfo& info(Var v) {
  for (const auto& i : table())
    if (i.var == v) return i;
  TORCH_CHECK(false, "torch_mgpu: an environment variable missing from the table");
}

std::optional<std::string> text(Var v) {
  const char* e = std::getenv(info(v).name);
  if (!e) return std::nullopt;
  return std::string(e);
}

int64_t integer(Var v, int64_t fallback) {
  const auto t = text(v);
  if (!t) return fallback;
  const VarInfo& i = info(v);
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(t->c_str(), &end, 10);
  TORCH_CHECK_VALUE(!t->empty() && errno == 0 && *end == '\0' && n >= i.min, i.name, "='", *t,
                    "' is not an integer of at least ", i.min);
  return static_cast<int64_t>(n);
}

int64_t integer_or_fallback(Var v, int64_t fallback) {
  try {
    return integer(v, fallback);
  } catch (const c10::Error&) {
    return fallback;
  }
}

std::optional<double> positive_number(Var v) {
  const auto t = text(v);
  if (!t) return std::nullopt;
  char* end = nullptr;
  const double x = std::strtod(t->c_str(), &end);
  TORCH_CHECK(end != t->c_str() && *end == '\0' && std::isfinite(x) && x > 0, "torch_mgpu: ", info(v).name,
              " must be a positive number of ", info(v).unit, ", got '", *t, "'");
  return x;
}

bool on_unless_zero(Var v) {
  const auto t = text(v);
  return !(t && *t == "0");
}

bool is_set(Var v) { return text(v).has_value(); }

std::string choice(Var v) {
  const VarInfo& i = info(v);
  const auto t = text(v);
  if (!t || t->empty()) return i.choices.at(0);
  std::string list;
  for (const auto& c : i.choices) {
    if (*t == c) return c;
    list += (list.empty() ? "" : ", ") + c;
  }
  TORCH_CHECK_VALUE(false, i.name, ": unknown value '", *t, "' (expected one of ", list, ")");
}

void check_all() {
  // Each variable as its readers read it (they call these same functions).
  for (const auto& i : table()) {
    switch (i.kind) {
      case Kind::Integer:
        integer(i.var, 0);
        break;
      case Kind::Number:
        positive_number(i.var);
        break;
      case Kind::Choice:
        choice(i.var);
        break;
      case Kind::Tiers: {
        const auto c = text(i.var);
        if (c && !c->empty() && *c != "on" && *c != "off") integer(i.var, 0);
        break;
      }
      case Kind::Text:
      case Kind::Switch:
        break;
    }
  }
}

} // namespace torch_mgpu::ir::env
