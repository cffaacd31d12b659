// The Python caller of a recorded op, for errors raised at a sync: the
// innermost Python frame outside torch's and torch_mgpu's own files (a
// user's line, not nn/functional.py), as an interned "file.py:12".
//
// Ops reach mgpu with the GIL released (torch's bindings drop it around a
// call), and taking it back costs about as much as a tenth of recording the
// op. On CPython 3.11 a call site met before is named without it: the
// calling thread's own frames are read directly (only that thread changes
// them, and it is here), and only cached answers are used, whose code
// objects are held. Anything new, and other Python versions, take the GIL.
#include "python/caller.h"

#include "capture/caller.h"
#include "ir/node.h"
#include "runtime/counters.h"

#include <Python.h>
#include <frameobject.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define TORCH_MGPU_FRAMES_WITHOUT_GIL 1
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif

#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch_mgpu::python {
namespace {

// Guarded by the state lock (the caller is asked for under it; filling
// the caches also takes the GIL, for the interpreter's objects). The
// caches hold a reference to each code object they key: a freed code
// object's address may be taken by another one (a loop that compiles and
// runs code), which must not inherit its answers.
// A call site: a code object and the offset of its instruction in it (the
// line number is worked out once per site: finding it walks the line table).
struct Site {
  PyCodeObject* code;
  int instruction;
  bool operator==(const Site& o) const { return code == o.code && instruction == o.instruction; }
};
struct SiteHash {
  size_t operator()(const Site& s) const {
    return std::hash<const void*>()(s.code) ^ (static_cast<size_t>(s.instruction) * 0x9E3779B97F4A7C15ULL);
  }
};

struct Callers {
  std::vector<std::string> internal_dirs;                     // torch's and torch_mgpu's packages
  std::unordered_map<PyCodeObject*, bool> internal;           // by code object
  std::unordered_map<Site, std::string_view, SiteHash> locations;
  std::vector<PyObject*> held;                                // the code objects keyed above
  void hold(PyCodeObject* code) {
    if (held.size() >= 50000) {  // bounded: forget everything, let the code objects go
      internal.clear();
      locations.clear();
      // Swapped out first: a release may run Python (a weakref callback)
      // that records an op and comes back here.
      std::vector<PyObject*> released;
      released.swap(held);
      for (PyObject* o : released) Py_DECREF(o);
    }
    Py_INCREF(code);
    held.push_back(reinterpret_cast<PyObject*>(code));
  }
};
Callers& callers() {
  static auto* c = new Callers();  // leaked: read until the process ends
  return *c;
}

bool is_internal(Callers& c, PyCodeObject* code) {
  auto it = c.internal.find(code);
  if (it != c.internal.end()) return it->second;
  bool inside = false;
  if (const char* file = PyUnicode_AsUTF8(code->co_filename)) {
    for (const auto& d : c.internal_dirs) inside = inside || std::string(file).rfind(d, 0) == 0;
  } else {
    PyErr_Clear();
  }
  c.hold(code);
  c.internal.emplace(code, inside);
  return inside;
}

// Where `frame` (running `code`) is: "file.py:12".
std::string_view location(Callers& c, PyCodeObject* code, PyFrameObject* frame) {
  is_internal(c, code);  // holds the code object
#if PY_VERSION_HEX >= 0x030B0000
  const Site key{code, PyFrame_GetLasti(frame)};
#else
  const Site key{code, PyFrame_GetLineNumber(frame)};
#endif
  auto it = c.locations.find(key);
  if (it != c.locations.end()) return it->second;
  std::string where = "?";
  if (const char* file = PyUnicode_AsUTF8(code->co_filename)) where = file;
  else PyErr_Clear();
  where.push_back(':');
  where.append(std::to_string(PyFrame_GetLineNumber(frame)));
  return c.locations.emplace(key, ir::intern(where)).first->second;
}

#ifdef TORCH_MGPU_FRAMES_WITHOUT_GIL
// The same walk as python_caller's, over the thread's interpreter frames
// (PyEval_GetFrame and PyFrame_GetBack skip incomplete frames: so does
// this), answered from the caches alone; nullopt where a frame on the way
// or the site found is not in them. A code object in the caches is held, so
// a frame whose code has its address runs that very code object.
std::optional<std::string_view> cached_caller(Callers& c, PyThreadState* ts) {
  auto complete = [](_PyInterpreterFrame* f) {
    while (f && _PyFrame_IsIncomplete(f)) f = f->previous;
    return f;
  };
  auto site = [&](_PyInterpreterFrame* f) -> std::optional<std::string_view> {
    const int lasti = _PyInterpreterFrame_LASTI(f);
    const Site key{f->f_code, lasti < 0 ? -1 : lasti * static_cast<int>(sizeof(_Py_CODEUNIT))};
    auto it = c.locations.find(key);
    if (it == c.locations.end()) return std::nullopt;
    return it->second;
  };
  _PyInterpreterFrame* f = complete(ts->cframe ? ts->cframe->current_frame : nullptr);
  for (int depth = 0; f && depth < 32; ++depth) {
    auto it = c.internal.find(f->f_code);
    if (it == c.internal.end()) return std::nullopt;
    if (!it->second) return site(f);
    _PyInterpreterFrame* back = complete(f->previous);
    if (!back) return site(f);  // all frames internal: the outermost
    f = back;
  }
  return std::string_view();
}
#endif

std::string_view python_caller() {
  // Threads that never ran Python (lanes, a C++ program's own threads)
  // have no caller to name.
  if (!Py_IsInitialized()) return {};
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr) return {};
#ifdef TORCH_MGPU_FRAMES_WITHOUT_GIL
  if (auto known = cached_caller(callers(), ts)) {
    runtime::counters().callers_without_gil++;
    return *known;
  }
#endif
  PyGILState_STATE gil = PyGILState_Ensure();
  std::string_view where;
  Callers& c = callers();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  PyFrameObject* outermost_internal = nullptr;
  for (int depth = 0; frame && depth < 32 && where.empty(); ++depth) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    if (!is_internal(c, code)) where = location(c, code, frame);
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    if (where.empty() && !back) {
      Py_XDECREF(outermost_internal);
      outermost_internal = frame;  // all frames internal: name the outermost
      frame = nullptr;
      break;
    }
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  if (where.empty() && outermost_internal) {
    PyCodeObject* code = PyFrame_GetCode(outermost_internal);
    where = location(c, code, outermost_internal);
    Py_DECREF(code);
  }
  Py_XDECREF(outermost_internal);
  PyGILState_Release(gil);
  return where;
}

} // namespace

void install_caller(std::vector<std::string> internal_dirs) {
  callers().internal_dirs = std::move(internal_dirs);
  capture::set_caller_provider(&python_caller);
}

} // namespace torch_mgpu::python
