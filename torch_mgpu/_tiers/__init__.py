"""Tier 1 of the lazy path: hot graphs compiled in the background.

The engine (csrc/engine/tiers.h) counts the syncs of each graph (its
structure and its constants). Once a graph has run `compile_hits` times node
by node, it is queued here: a daemon thread turns it into one inductor
function and hands it back, and the engine runs that function for later
syncs of the graph when it measures faster than the node-by-node run.
A graph with independent branches also comes split into parts (the
torch.compile backend's split, made by the engine): each part is compiled
on its own with the C++ wrapper (which lets go of the GIL), and the engine
runs them side by side on the lanes; it times both ways and keeps the
faster.

A graph reaches this package as plain data: its leaves (storages it reads, by
size), its nodes (op, arguments, which values they read and write) and its
roots (values the sync needs). It is replayed here as a function of the
leaves' bytes, traced with make_fx into an ATen graph and compiled with
inductor's `compile_fx`. The function is pure: a node that writes in place
writes a copy of what it writes (the copy is free after inductor's passes
where nothing reads the old bytes), so that a compiled run that fails can
run again node by node.

FX tracing keeps process-wide state (`torch.fx._symbolic_trace`'s tracing
flag and patcher), which torch.compile on another thread reads and writes:
the thread compiles while holding dynamo's compile lock (no frame compiles
beside it), and while it traces, calls of functions torch.compile already
compiled run their compiled code instead of refusing ("Detected that you
are using FX to symbolically trace a dynamo-optimized function").

The package by job: compile.py holds the compile thread and compiles a
request (compile_request, compile_ways); replay.py replays a graph as a
function (replay_fn); lifting.py traces it and lifts varying constants into
inputs (lift); numerics.py holds eager's numerics that inductor's code
would not keep; common.py the pieces they share (the request's records as
named tuples, made once as a request arrives: Arg, Ref, Geometry, Output,
Written).
"""
import sys

# The names other code reaches as torch_mgpu._tiers.NAME (torch_mgpu's
# configure() and exit, tests; a test replaces compile_request here, which
# compile_ways looks up here).
from .common import Unsupported
from .compile import compile_request, compile_ways, loop_threads, set_compile, start, stop, wait_for_compiles
from .lifting import lift, lift_candidates
from .replay import _strided_read, replay_fn


def __getattr__(name):
    # The compile thread (None before the first start) is compile.py's
    # global, which start() replaces: read there, not copied here.
    if name == "_thread":
        return sys.modules[__name__ + ".compile"]._thread
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
