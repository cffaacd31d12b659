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
  AtCall,
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

// How a variable's text is read (and refused at import, check_all()).
enum class Kind {
  Text,      // read as it is (a list of devices, a test's setting)
  Switch,    // on unless "0", or set at all
  Integer,   // a whole number of at least `min`
  Number,    // a finite number above 0, in `unit`
  Choice,    // one of `choices` (the first where unset or empty)
  Tiers,     // TORCH_MGPU_COMPILE: on, off, or an Integer
};

struct VarInfo {
  Var var;
  const char* name;          // TORCH_MGPU_...
  const char* fallback;      // what holds when it is not set, in words
  const char* meaning;       // what it does, one line
  Kind kind = Kind::Text;
  int64_t min = 0;                   // Integer, Tiers
  const char* unit = "";             // Number
  std::vector<std::string> choices;  // Choice
};

const std::vector<VarInfo>& table();
const VarInfo& info(Var v);

// The variable's text; nullopt where it is not set.
std::optional<std::string> text(Var v);
// A whole integer of at least the table's `min`, or `fallback` where not
// set; anything else raises a ValueError naming the variable.
int64_t integer(Var v, int64_t fallback);
// A finite number above 0 (in the table's `unit`), or nullopt where not
// set; anything else raises.
std::optional<double> positive_number(Var v);
// On unless set to "0" (an on/off switch whose default is on).
bool on_unless_zero(Var v);
// Whether it is set at all (to anything).
bool is_set(Var v);
// One of the table's `choices`, the first where not set (or empty); else raises.
std::string choice(Var v);

// Parses every variable that is set, so that a bad value raises at the
// import of torch_mgpu (and the lanes' first use in C++) rather than in
// whatever reads it first.
void check_all();

// `integer`, but `fallback` where the text does not parse: for readers
// that must not throw (an allocator, a thread's start), whose variable
// check_all() has refused already.
int64_t integer_or_fallback(Var v, int64_t fallback);

} // namespace torch_mgpu::ir::env
