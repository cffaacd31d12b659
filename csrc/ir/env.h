#pragma once
// Every TORCH_MGPU_* environment variable, listed once (env.cpp's table):
// its name, the default, what it does, and how its text is parsed. No other
// file reads the environment (test/test_build.py checks it); Python reads
// its variables through `torch_mgpu._C._env_text`, which takes only names
// of the table. README's "Environment variables" is this table.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torch_mgpu::ir::env {

enum class Var {
  Devices,
  Lanes,
  Policy,
  Sync,
  AsyncOps,
  MaxPending,
  Compile,
  CompileChoice,
  Refine,
  Fusion,
  Caller,
  SpinUs,
  HostCacheMb,
  FullProbeNumel,
  NoCalibration,
  NetworkGbps,
  NetworkLatencyUs,
  RemoteTimeout,
  WorkerThreads,
  WireVersion,
  Fault,
};

struct VarInfo {
  Var var;
  const char* name;          // TORCH_MGPU_...
  const char* fallback;      // what holds when it is not set, in words
  const char* meaning;       // what it does, one line
};

const std::vector<VarInfo>& table();
const VarInfo& info(Var v);

// The variable's text; nullopt where it is not set.
std::optional<std::string> text(Var v);
// A whole integer of at least `min`, or `fallback` where not set; anything
// else raises a ValueError naming the variable.
int64_t integer(Var v, int64_t fallback, int64_t min);
// A finite number above 0, or nullopt where not set; anything else raises.
std::optional<double> positive_number(Var v, const char* unit);
// On unless set to "0" (an on/off switch whose default is on).
bool on_unless_zero(Var v);
// Whether it is set at all (to anything).
bool is_set(Var v);
// One of `choices`, or `fallback` where not set (or empty); else raises.
std::string choice(Var v, const std::vector<std::string>& choices, const std::string& fallback);

// Parses every variable that is set, so that a bad value raises at the
// import of torch_mgpu (and the lanes' first use in C++) rather than in
// whatever reads it first.
void check_all();

// `integer`, but `fallback` where the text does not parse: for readers
// that must not throw (an allocator, a thread's start), whose variable
// check_all() has refused already.
int64_t integer_or_fallback(Var v, int64_t fallback, int64_t min);

} // namespace torch_mgpu::ir::env
