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



def follow_lanes_device() -> None:
    """Choices PyTorch makes by device type are made for mgpu as for the
    device its lanes are on. `F.linear_cross_entropy`'s chunked path picks
    its accumulation dtype and policy per device type (on CPU it multiplies
    bfloat16 into float32; for a device it does not know it multiplies in
    bfloat16, which on CPU is emulated, slower and further from eager's
    values): its options resolve for mgpu as for the lanes' device."""
    try:
        options = importlib.import_module("torch.nn.modules.linear_cross_entropy_options")
    except ImportError:
        return
    cls = getattr(options, "LinearCrossEntropyOptions", None)
    adjust = getattr(cls, "_adjust", None)
    if adjust is None or getattr(adjust, "_mgpu_follows_lanes", False):
        return

    @functools.wraps(adjust)
    def _adjust(self, *args, **kwargs):
        if len(args) > 4:
            args = args[:4] + (_lanes_device_for(args[4]),) + args[5:]
        elif "device" in kwargs:
            kwargs["device"] = _lanes_device_for(kwargs["device"])
        return adjust(self, *args, **kwargs)

    _adjust._mgpu_follows_lanes = True
    cls._adjust = _adjust


def _lanes_device_for(device):
    """`device`, or for an mgpu device the device its lanes are on (the first
    CUDA device of the lanes, else the CPU)."""
    if not (isinstance(device, torch.device) and device.type == "mgpu"):
        return device
    cuda = [str(n).split("/")[0] for n in _C.lanes() if str(n).startswith("cuda")]
    return torch.device(cuda[0] if cuda else "cpu")
