"""Tier 1 of the lazy path: hot graphs compiled in the background.

The engine (csrc/engine/tiers.h) counts the syncs of each graph (its
structure and its constants). Once a graph has run `compile_hits` times node
by node, it is queued here: a daemon thread turns it into one inductor
function and hands it back, and the engine runs that function for later
syncs of the graph when it measures faster than the node-by-node run.

A graph reaches this file as plain data: its leaves (storages it reads, by
size), its nodes (op, arguments, which values they read and write) and its
roots (values the sync needs). It is replayed here as a function of the
leaves' bytes, traced with make_fx into an ATen graph and compiled with
inductor's `compile_fx`. The function is pure: a node that writes in place
writes a copy of what it writes (the copy is free after inductor's passes
where nothing reads the old bytes), so that a compiled run that fails can
run again node by node.
"""
import threading
import time

import torch

from . import _C

_thread = None
_lock = threading.Lock()


class Unsupported(Exception):
    """A graph tier 1 does not take; it stays in tier 0."""


def _op(name, overload):
    ns, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, ns), op)
    return getattr(packet, overload or "default")


def _flat_dtypes(req):
    """The dtype each leaf is read as (one per leaf)."""
    dtypes = [None] * len(req["leaves"])
    for node in req["nodes"]:
        for _, _, (kind, value) in node["args"]:
            refs = [value] if kind == "t" else value if kind == "l" else []
            for r in refs:
                if r is None:
                    continue
                v = node["operands"][r[0]]
                if v < len(dtypes):
                    dt = r[1][3]
                    if dtypes[v] is not None and dtypes[v] != dt:
                        raise Unsupported("a storage read as two dtypes")
                    dtypes[v] = dt
    return [d if d is not None else torch.uint8 for d in dtypes]


def _contiguous(sizes, strides):
    expected = 1
    for d, st in zip(reversed(sizes), reversed(strides)):
        if d != 1 and st != expected:
            return False
        expected *= d
    return True


def replay_fn(req):
    """The graph as a function of its leaves' bytes (flat tensors),
    returning the roots: a fresh output as the op returned it, a storage
    written in place as its flat bytes."""
    n_leaves = len(req["leaves"])
    nodes = req["nodes"]
    roots = req["roots"]
    # Where each value is last read, so a write copies only what is read after.
    last_read = {}
    for i, node in enumerate(nodes):
        for v in node["operands"]:
            last_read[v] = i
    root_set = set(roots)
    ops = [_op(n["op"], n["overload"]) for n in nodes]

    def run(*leaves):
        env = {k: (leaves[k], None) for k in range(n_leaves)}  # value -> (base tensor, fresh geometry)

        def view(v, geom):
            base, fresh = env[v]
            sizes, strides, offset, dtype = geom
            if base.dtype != dtype:
                raise Unsupported("a storage read as another dtype")
            if fresh is not None and fresh == (sizes, strides, offset):
                return base
            numel = 1
            for d in sizes:
                numel *= d
            if fresh is None and _contiguous(sizes, strides) and offset + numel <= base.numel():
                # Views inductor follows better than as_strided.
                return base.narrow(0, offset, numel).view(sizes)
            return torch.as_strided(base, sizes, strides, offset)

        for i, (node, op) in enumerate(zip(nodes, ops)):
            operands = node["operands"]
            written = {}
            for value, mutated, _, _, _ in node["outputs"]:
                if mutated >= 0:
                    v = operands[mutated]
                    base, fresh = env[v]
                    if v < n_leaves or last_read.get(v, -1) > i or v in root_set:
                        base = torch.clone(base)
                    written[mutated] = (base, fresh)
            saved = {}
            for m, entry in written.items():
                saved[operands[m]] = env[operands[m]]
                env[operands[m]] = entry
            same = {}

            def tensor(r):
                if r is None:
                    return None
                operand, geom, tag = r
                if tag >= 0 and tag in same:
                    return same[tag]
                t = view(operands[operand], geom)
                if tag >= 0:
                    same[tag] = t
                return t

            args, kwargs = [], {}
            for name, kwarg_only, (kind, value) in node["args"]:
                if kind == "c":
                    a = value
                elif kind == "t":
                    a = tensor(value)
                else:
                    a = [tensor(r) for r in value]
                if kwarg_only:
                    kwargs[name] = a
                else:
                    args.append(a)
            out = op(*args, **kwargs)
            for v, entry in saved.items():
                env[v] = entry
            flat = []
            stack = [out]
            while stack:
                x = stack.pop(0)
                if isinstance(x, (list, tuple)):
                    stack[:0] = list(x)
                elif isinstance(x, torch.Tensor):
                    flat.append(x)
            for value, mutated, returned, _, geom in node["outputs"]:
                if mutated >= 0:
                    env[value] = written[mutated]
                else:
                    t = flat[returned]
                    sizes, strides, offset, _ = geom
                    if offset != 0:
                        raise Unsupported("a fresh output at an offset")
                    env[value] = (t, (sizes, strides, offset))
        return tuple(env[v][0] for v in roots)

    return run


def compile_request(req):
    """(compiled function, input dtypes, description) for one hot graph."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    dtypes = _flat_dtypes(req)
    examples = []
    for nbytes, dt in zip(req["leaves"], dtypes):
        itemsize = torch.empty(0, dtype=dt).element_size()
        examples.append(torch.zeros(nbytes // itemsize, dtype=dt))
    fn = replay_fn(req)
    with torch.no_grad():
        gm = make_fx(fn, tracing_mode="fake")(*examples)
        compiled = compile_fx(gm, examples)

    def call(tensors):
        with torch.no_grad():
            return list(compiled(*tensors))

    ops = sorted({n["op"].split("::")[-1] for n in req["nodes"]})
    return call, dtypes, f"{len(req['nodes'])} ops ({', '.join(ops[:6])}{', ...' if len(ops) > 6 else ''})"


def _serve():
    while True:
        req = _C._tier_next_request()
        if req is None:
            return
        t0 = time.perf_counter()
        try:
            fn, dtypes, description = compile_request(req)
        except Exception as e:  # the graph stays in tier 0
            _C._tier_reject(req["key"], f"{type(e).__name__}: {e}")
            continue
        seconds = time.perf_counter() - t0
        _C._tier_install(req["key"], fn, dtypes, seconds, f"{description}; compiled in {seconds:.2f} s")


def start():
    """Starts the compile thread (once per process)."""
    global _thread
    with _lock:
        if _thread is not None and _thread.is_alive():
            return
        _C._tier_compiler_present(True)
        _thread = threading.Thread(target=_serve, name="torch_mgpu-compile", daemon=True)
        _thread.start()


def stop():
    _C._tier_stop()


def set_compile(hits):
    """configure(compile=...): False / 0 turns tier 1 off, True takes the
    default hit count (2), an int sets it."""
    if hits is True:
        hits = 2
    elif hits is False or hits is None:
        hits = 0
    hits = int(hits)
    if hits < 0:
        raise ValueError(f"compile must be a bool or a hit count >= 0, got {hits}")
    _C._set_tier_compile_hits(hits)
    if hits:
        start()


def wait_for_compiles(timeout: float = 600.0) -> bool:
    """Waits until no hot graph is queued or compiling; True when none is."""
    return _C._tier_wait(float(timeout))
