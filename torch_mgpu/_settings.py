"""Process-wide settings and background flights.

A recorded op runs under the settings of its call (the default dtype,
deterministic mode, matmul precision): a foreground sync sets them around
the graph it runs. A background flight cannot (they are process-wide, and the
program goes on calling ops meanwhile), so its kernels read them as they are
while it runs. torch's functions that change them therefore wait here for the
flight in progress first; ops called after the change start new graphs
(capture cuts the graph where the settings change)."""
import functools
import importlib
import sys

import torch

from . import _C

_SETTERS = ("set_default_dtype", "set_default_tensor_type", "use_deterministic_algorithms",
            "set_deterministic_debug_mode", "set_float32_matmul_precision")


def _after_flight(fn):
    if getattr(fn, "_mgpu_waits_for_flight", False):
        return fn

    @functools.wraps(fn)
    def setter(*args, **kwargs):
        _C._wait_for_flight()
        return fn(*args, **kwargs)

    setter._mgpu_waits_for_flight = True
    return setter


def install() -> None:
    for name in _SETTERS:
        fn = getattr(torch, name, None)
        if fn is not None:
            setattr(torch, name, _after_flight(fn))
    # torch.utils.deterministic.fill_uninitialized_memory is a module property.
    try:
        importlib.import_module("torch.utils.deterministic")
    except ImportError:
        pass
    det = sys.modules.get("torch.utils.deterministic")
    prop = getattr(type(det), "fill_uninitialized_memory", None) if det is not None else None
    if isinstance(prop, property) and prop.fset is not None:
        type(det).fill_uninitialized_memory = property(prop.fget, _after_flight(prop.fset), prop.fdel, prop.__doc__)
