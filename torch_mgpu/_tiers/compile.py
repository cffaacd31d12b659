"""The compile thread: a hot graph's request traced and compiled with
inductor (compile_request, compile_ways), handed back to the engine (_serve),
and the thread's start, stop and settings."""
import contextlib
import sys
import threading
import time

import torch

from .. import _C
from .common import Unsupported, records
from .lifting import lift
from .numerics import _number_rounding

_thread = None
_lock = threading.Lock()


def _flat_dtypes(req):
    """The dtype each leaf is read as (one per leaf)."""
    dtypes = [None] * len(req["leaves"])
    for node in req["nodes"]:
        for _, _, kind, value in node["args"]:
            refs = [value] if kind == "t" else value if kind == "l" else []
            for r in refs:
                if r is None:
                    continue
                v = node["operands"][r.operand]
                if v < len(dtypes):
                    dt = r.geom.dtype
                    if dtypes[v] is not None and dtypes[v] != dt:
                        raise Unsupported("a storage read as two dtypes")
                    dtypes[v] = dt
    return [d if d is not None else torch.uint8 for d in dtypes]


def _cat_read_in_graph(gm):
    """Whether the result of a cat in the traced graph is read by another of
    its nodes (not only returned). A cat into an `out=` tensor counts as
    read: its buffer's other views are read, not the node."""
    cat = torch.ops.aten.cat
    return any(n.op == "call_function" and getattr(n.target, "overloadpacket", None) is cat
               and (n.target is not cat.default or any(u.op != "output" for u in n.users))
               for n in gm.graph.nodes)


def loop_threads():
    """OpenMP threads of a compiled graph's loops: the cores each lane has.
    The lanes are the parallelism; loops on two threads that share two
    cores with the other lane (or another process) wait at every loop's
    barrier for the core the other thread lost: a 64-column graph ran
    130 ms a call instead of 0.1 ms on a loaded 2-core machine."""
    from ..compile import _cpu_threads
    return _cpu_threads(len(_C.lanes()))


def compile_request(req):
    """(compiled function, input dtypes, description, lifted constants) for
    one hot graph, or one part of a split one (`req["split"]`: its number
    of parts), for the lanes' device (`req["device"]`: the host, or the GPU
    whose streams the lanes are). A host part runs beside the others: it is
    compiled with the C++ wrapper, which lets go of the GIL, and its loops
    take its lane's share of the cores."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from ..compile import _cpu_threads

    dtypes = _flat_dtypes(req)
    device = torch.device(req.get("device", "cpu"))
    examples = []
    for nbytes, dt in zip(req["leaves"], dtypes):
        itemsize = torch.empty(0, dtype=dt).element_size()
        examples.append(torch.zeros(nbytes // itemsize, dtype=dt, device=device))
    split = req.get("split", 0) > 1
    with torch.no_grad():
        gm, lifted = lift(req, examples)
        examples += [torch.tensor(0.5, dtype=torch.float64, device=device) for _ in lifted]
        # Tier 0's numbers: a half or bfloat16 result is rounded to its
        # dtype between fused ops, as eager does (inductor keeps float32
        # across them, and a floor or a comparison then differs by a whole
        # unit). A cat read in the graph is a loop of its own, not its
        # inputs' producers writing into views of its buffer: a reader of
        # that buffer through the replay's as_strided view was fused into
        # the same kernel before those writes (difffuzz seed 3968789: a
        # stack's gradient read uninitialized bytes). A cat only returned
        # keeps inductor's way: as a loop of its own, the stack of 64
        # feature columns computed every column's chain again for each
        # element (10 ms a call against 1.5).
        patches = {"cpp.threads": _cpu_threads(req["lanes"]) if split else loop_threads(),
                   "emulate_precision_casts": True, "force_pointwise_cat": _cat_read_in_graph(gm)}
        # No autotuning, whatever the environment asks of inductor: it
        # benchmarks kernels over random inputs, drawn from the default
        # generators the program draws from (see _generators_left_alone).
        patches.update({k: False for k in _AUTOTUNING if hasattr(inductor_config, k)})
        if split and device.type == "cpu":
            # A host part's loops run in the wrapper: the C++ one lets go
            # of the GIL. A CUDA part's Python wrapper only queues kernels
            # on its lane's stream (the current one when it is called).
            patches["cpp_wrapper"] = True
        with inductor_config.patch(patches):
            compiled = compile_fx(gm, examples)

    # Lifted numbers that eager rounds to a half dtype (see
    # _number_rounding) are rounded as they are passed.
    rounding = _number_rounding(req["nodes"])
    rounded_inputs = [(len(req["leaves"]) + j, rounding[node]) for j, (node, _) in enumerate(lifted) if node in rounding]

    def call(tensors):
        if rounded_inputs:
            tensors = list(tensors)
            for pos, dt in rounded_inputs:
                tensors[pos] = tensors[pos].to(dt).to(tensors[pos].dtype)
        with torch.no_grad():
            return list(compiled(*tensors))

    ops = sorted({n["op"].split("::")[-1] for n in req["nodes"]})
    description = f"{len(req['nodes'])} ops ({', '.join(ops[:6])}{', ...' if len(ops) > 6 else ''})"
    if lifted:
        description += f", {len(lifted)} constant(s) as inputs"
    return call, dtypes, description, lifted


def compile_ways(req):
    """The ways a hot graph is compiled, each (parts, compile seconds,
    description), a part (function, dtypes, lifted constants, description):
    the whole graph as one part, and for a graph with independent branches
    (`req["parts"]`) also its parts, run side by side on the lanes. The
    engine times each way on trial and keeps the fastest."""
    # compile_request as the package has it (torch_mgpu._tiers), where a
    # test may put another in its place.
    compile_one = sys.modules[__package__].compile_request
    ways = []
    t0 = time.perf_counter()
    fn, dtypes, description, lifted = compile_one(req)
    seconds = time.perf_counter() - t0
    ways.append(([(fn, dtypes, lifted, description)], seconds, f"{description}; compiled in {seconds:.2f} s"))
    parts = req["parts"]
    if parts:
        t0 = time.perf_counter()
        try:
            compiled = [compile_one(dict(part, split=len(parts), lanes=req["lanes"])) for part in parts]
        except Exception as e:  # the parts do not compile: the whole graph still may run in tier 1
            whole, seconds, description = ways[0]
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            if len(reason) > 300:
                reason = reason[:297] + "..."
            ways[0] = (whole, seconds, f"{description}; its {len(parts)} parts did not compile ({reason})")
            return ways
        seconds = time.perf_counter() - t0
        lanes = {}
        for part, (_, _, d, _) in zip(parts, compiled):
            lanes.setdefault(part["lane"], []).append(d)
        ops = sum(len(p["nodes"]) for p in parts)
        description = f"{ops} ops in {len(parts)} parts on {len(lanes)} lanes: " + "; ".join(
            f"lane {lane}: " + " then ".join(d) for lane, d in sorted(lanes.items()))
        ways.append(([(fn, dtypes, lifted, d) for fn, dtypes, d, lifted in compiled], seconds,
                     f"{description}; compiled in {seconds:.2f} s"))
    return ways


# Inductor's settings that benchmark candidate kernels at compile time.
_AUTOTUNING = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise", "benchmark_fusion",
               "benchmark_epilogue_fusion", "benchmark_kernel")

_local = threading.local()
_preserve_rng_state = None  # torch._dynamo.utils.preserve_rng_state as torch has it


def _preserve_rng_state_but_on_the_compile_thread():
    """torch's preserve_rng_state, a no-op on the compile thread."""
    if getattr(_local, "compiling", False):
        return contextlib.nullcontext()
    return _preserve_rng_state()


def _take_over_preserve_rng_state():
    """Puts _preserve_rng_state_but_on_the_compile_thread in place of
    torch's preserve_rng_state in every torch module that holds it (those
    imported since the last call too)."""
    global _preserve_rng_state
    try:
        from torch._dynamo import utils
    except ImportError:  # another torch: nothing to take over
        return
    if _preserve_rng_state is None:
        _preserve_rng_state = utils.preserve_rng_state
    for name, module in list(sys.modules.items()):
        if name.startswith("torch") and getattr(module, "__dict__", {}).get("preserve_rng_state") is _preserve_rng_state:
            module.preserve_rng_state = _preserve_rng_state_but_on_the_compile_thread


@contextlib.contextmanager
def _generators_left_alone():
    """Inductor and AOT autograd keep the default generators' states across
    a compile (preserve_rng_state: read at its start, set back at its end).
    On this thread, beside the program's, the set-back would undo every draw
    the program made meanwhile, whose numbers would then come again. Here
    it does nothing: the compile of a hot graph draws nothing (a graph
    with a random op is not compiled, and autotuning, which draws its
    inputs, is off: compile_request)."""
    _take_over_preserve_rng_state()
    _local.compiling = True
    try:
        yield
    finally:
        _local.compiling = False


@contextlib.contextmanager
def _apart_from_dynamo():
    """Serializes a tier-1 compile with torch.compile's frame compiles, and
    keeps compiled functions called meanwhile on other threads from seeing
    this thread's FX trace as theirs."""
    try:
        from torch._dynamo import config, convert_frame
        lock = convert_frame.compile_lock
    except (ImportError, AttributeError):  # another torch: no guard to take
        yield
        return
    # The setting's default, not an override: overrides are thread-local,
    # and it is the other threads' calls that must see it.
    entry = getattr(config, "_config", {}).get("force_compile_during_fx_trace")
    with lock:
        if entry is None or not hasattr(entry, "default"):
            yield
            return
        saved = entry.default
        entry.default = True
        try:
            yield
        finally:
            entry.default = saved


def _serve():
    while True:
        req = _C._tier_next_request()
        if req is None:
            return
        try:
            req = records(req)  # the nodes' records as named tuples
            with _apart_from_dynamo(), _generators_left_alone():
                ways = compile_ways(req)
        except Exception as e:  # the graph stays in tier 0
            _C._tier_reject(req["key"], f"{type(e).__name__}: {e}")
            continue
        _C._tier_install(req["key"], ways)


def start():
    """Starts the compile thread (once per process)."""
    global _thread
    with _lock:
        if _thread is not None and _thread.is_alive():
            return
        _C._tier_compiler_present(True)
        _thread = threading.Thread(target=_serve, name="torch_mgpu-compile", daemon=True)
        _thread.start()


def stop(timeout: float = 30.0):
    """Stops the compile thread and waits for it (at exit: a thread left
    waiting in C++ for the next hot graph would be torn down by the
    interpreter's finalization as it takes the GIL back, which aborts the
    process). A compile in progress is waited for up to `timeout` seconds."""
    _C._tier_stop()
    with _lock:
        thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout)


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
