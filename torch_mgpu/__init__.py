"""torch_mgpu: the `mgpu` device. Ops on mgpu tensors are recorded, not run;
at a sync point the recorded graph is planned over lanes and executed.

    import torch, torch_mgpu
    x = torch.randn(4, 4, device="mgpu")
    y = (x @ x).relu()          # recorded
    print(y.cpu())              # runs
"""
import atexit

import torch

from . import _C  # loads libtorch_mgpu: registers the PrivateUse1 backend as "mgpu"

_C._check_env()  # a TORCH_MGPU_* variable that does not parse raises here, naming it
from . import device as _device_module
from . import _backward, _meta_warnings, _settings, _tiers
from ._plan import Plan, Simulation, device_profiles, last_plan, simulate

def _install_caller() -> None:
    # An error raised when the pending graph runs names the line that
    # recorded the failing op: the innermost frame outside these packages.
    import os
    _C._install_caller([os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep])


_install_caller()
_settings.install()
_meta_warnings.install()
_backward.install()
_settings.follow_lanes_device()

if not hasattr(torch, "mgpu"):
    torch.utils.rename_privateuse1_backend("mgpu")
    torch._register_device_module("mgpu", _device_module)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)


def _register_compile_backend() -> None:
    # An installed torch_mgpu is found by dynamo through its
    # `torch_dynamo_backends` entry point when torch.compile first asks for
    # "mgpu": importing dynamo here would double the cost of `import torch`
    # once the device autoloads. Registered here only when dynamo is loaded
    # already, or when the package has no entry points (run from a source
    # tree without being installed).
    import sys
    from importlib.metadata import entry_points
    installed = any(ep.name == "mgpu" for ep in entry_points(group="torch_dynamo_backends"))
    if installed and "torch._dynamo" not in sys.modules:
        return
    try:
        from .compile import register
        register()
    except Exception:  # dynamo unavailable: torch.compile is optional
        pass


_register_compile_backend()


def compile_choices() -> list:
    """How each live graph compiled by `torch.compile(..., backend="mgpu")`
    runs: one dict per graph, oldest first, with `id`, `partitions` (how
    many it was split into), `choice` ("partitions": planned over the lanes; "whole": one
    inductor call; None while its first calls time both) and the measured
    medians `partitions_s` and `whole_s` (None until timed)."""
    from .compile import compile_choices as choices
    return choices()


def trace_choices() -> list:
    """How each repeated trace runs (the ops a program calls between two of
    its reads: a sync, a copy to the host, `item()`): one dict per trace, the
    most recently run first, with `trace` (its hash), `ops`, `runs`, `way`
    ("lazy": recorded and run at the read, tier 0 or 1; "at the call": each
    op's CPU kernel from its call, as eager; "at the call, one thread"),
    `state` ("watched" until it is tried, "on trial", "chosen"), the medians
    of its last trial per way (`medians_s`, in the order lazy, at the call,
    one thread) and `why`. See configure(at_call=...)."""
    return _C._trace_choices()


def synchronize() -> None:
    """Run every pending op. Raises the first error an op raised."""
    _C.synchronize()


def pending_ops() -> int:
    """Number of ops recorded and not yet run."""
    return _C.pending_ops()


def stats() -> dict:
    """Counters since start: ops_captured, ops_executed, plans_built,
    plan_cache_hits, eager_fallbacks, bytes_transferred, and more."""
    return dict(_C.stats())


def empty_cache() -> None:
    """Releases the large host blocks the lanes keep for reuse (counted in
    stats()["host_cache_bytes"]; TORCH_MGPU_HOST_CACHE_MB bounds them, default
    1024, 0 turns the cache off). Eager tensors never use these blocks."""
    _C.empty_cache()


def configure(devices=None, lanes_per_device=None, policy=None, compile=None, at_call=None) -> None:
    """Sets where pending graphs run, and how.

    devices: ["cpu"] (one device, its lanes are worker threads), ["cpu", "cpu"]
    (two virtual devices: values crossing them are copied, as between GPUs),
    or ["cuda:0", "cuda:1"] (each lane a stream of its device). "rankN:cpu" is
    the CPU of worker rank N of the default torch.distributed process group,
    "rankN:cuda:K" its CUDA device K, one lane each (this process is rank 0;
    the workers run `python -m torch_mgpu.worker`, or start everything with
    `torchrun ... -m torch_mgpu.launch script.py`). CPU and CUDA devices do
    not mix; remote CUDA devices come after one of this process's own.
    lanes_per_device: lanes on each device (default: the host's cores shared
    among CPU devices, 4 streams per CUDA device). policy: "auto" (default),
    "heft" or "serial". Arguments left None keep their current value.
    compile: tier 1 of the lazy path (on by default, at 2): a graph that has
    run this many times node by node (True: 2) is compiled with inductor in
    the background, and later syncs of it run the compiled code when it
    measures faster; False or 0 turns it off (results bitwise equal to
    eager's).
    at_call: how a repeated trace runs (the ops between two reads of the
    program's values): "auto" (the default) tries the lazy way against
    running each op at its call, as eager does (with the caller's intra-op
    threads, or with one), and keeps the faster, tried again from time to
    time; True or "on" runs every op at its call; False or "off" records
    every op. Only on host lanes (CUDA lanes record). `trace_choices()` says
    how each trace runs.
    Environment: TORCH_MGPU_DEVICES="cpu,cpu", TORCH_MGPU_LANES, TORCH_MGPU_POLICY,
    TORCH_MGPU_COMPILE (a hit count, "on" or "off"), TORCH_MGPU_AT_CALL.
    """
    if isinstance(devices, str):
        devices = [devices]
    if lanes_per_device is not None and int(lanes_per_device) < 1:
        raise ValueError(f"lanes_per_device must be >= 1, got {lanes_per_device}")
    devs = [str(d) for d in devices] if devices is not None else []
    if any(d.startswith("rank") for d in devs):
        _use_process_group()
    if any(d.startswith("cuda") for d in devs) and torch.cuda.is_available():
        # CUDA set up as torch.cuda sets it up (its fork check included),
        # before the lanes' streams are made.
        torch.cuda.init()
    if compile is not None:
        _tiers.set_compile(compile)
    if at_call is not None:
        _C._set_at_call(("on" if at_call else "off") if isinstance(at_call, bool) else str(at_call))
    if (compile is None and at_call is None) or devices is not None or lanes_per_device is not None or policy is not None:
        _C.configure(devs, int(lanes_per_device) if lanes_per_device is not None else 0, policy or "")


def _use_process_group() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch_mgpu: remote devices ('rankN:cpu', 'rankN:cuda:K') need a torch.distributed process group, and none is "
            "initialized (torch.distributed.init_process_group('gloo'), or start the program with "
            "torchrun ... -m torch_mgpu.launch script.py)"
        )
    pg = dist.group.WORLD
    if dist.get_backend(pg) != "gloo":
        raise RuntimeError(f"torch_mgpu: remote devices need a Gloo process group, not {dist.get_backend(pg)!r}")
    _C._set_process_group(pg)


def release_workers() -> None:
    """Tells every worker rank of the default process group to stop serving
    (their `python -m torch_mgpu.worker` then exits). torch_mgpu.launch does
    it when the program ends."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _C._set_process_group(dist.group.WORLD)
    _C._release_workers()


def wait_for_compiles(timeout: float = 600.0) -> bool:
    """Waits until no hot graph is queued or compiling in the background
    (tier 1, `configure(compile=...)`); True when none is left."""
    return _tiers.wait_for_compiles(timeout)


def lanes() -> list:
    """Names of the lanes plans run on, e.g. ['cpu:0/lane0', 'cpu:0/lane1']."""
    return list(_C.lanes())


def policy() -> str:
    return _C.policy()


def configuration() -> dict:
    """The current lanes as configure()'s arguments (devices,
    lanes_per_device, policy): `configure(**configuration())` sets them
    again after other settings."""
    return _configuration_of(lanes(), policy())


def _configuration_of(lane_names, policy_name) -> dict:
    devices = _device_module.devices_of(lane_names)
    # Virtual CPU devices (cpu:0, cpu:1) are each configured as "cpu"; a
    # worker rank's device ("rank1:cpu") has one lane of its own.
    local = [d for d in devices if not d.startswith("rank")]
    local_lanes = [n for n in lane_names if not n.startswith("rank")]
    return {"devices": ["cpu" if d.startswith("cpu") else d for d in devices],
            "lanes_per_device": max(1, len(local_lanes) // max(1, len(local))), "policy": policy_name}


def max_pending_ops() -> int:
    return _C.max_pending_ops()


def set_max_pending_ops(n: int) -> None:
    """A pending graph larger than `n` ops runs at once."""
    _C.set_max_pending_ops(int(n))


def async_ops() -> int:
    return _C.async_ops()


def set_async_ops(n: int) -> None:
    """Background execution: once `n` ops are pending (default 256,
    TORCH_MGPU_ASYNC_OPS), they start running on a background worker while
    Python goes on recording, so a long capture overlaps its own execution.
    0 turns it off. An error raised in the background surfaces at the next
    sync point. `simulate()` plans what is still pending: to simulate a
    capture longer than `n` ops, turn background execution off first."""
    _C.set_async_ops(int(n))


def _drain_at_exit() -> None:
    # Work still running in the background finishes before the interpreter
    # goes away; errors at exit are not reported.
    try:
        _C.synchronize()
    except Exception:
        pass


atexit.register(_drain_at_exit)
atexit.register(_tiers.stop)
if _C._tier_compile_hits():  # TORCH_MGPU_COMPILE
    _tiers.start()


__all__ = [
    "synchronize",
    "configure",
    "configuration",
    "lanes",
    "policy",
    "simulate",
    "device_profiles",
    "Simulation",
    "pending_ops",
    "stats",
    "empty_cache",
    "last_plan",
    "compile_choices",
    "trace_choices",
    "Plan",
    "max_pending_ops",
    "set_max_pending_ops",
    "async_ops",
    "set_async_ops",
    "wait_for_compiles",
]
