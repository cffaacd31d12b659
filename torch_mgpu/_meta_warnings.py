"""Out= resize warnings of PyTorch's Python Meta kernels under mgpu.

mgpu infers a call's results by running its Meta kernel. Many of those are
Python (torch._meta_registrations, most through torch._prims_common.wrappers'
out= wrapper), and their check that an out= tensor with elements is being
resized warns through Python's `warnings` at once (with a text of its own,
or through `torch._resize_output_`, which hands ATen's warning to Python on
return), beside the warning of the CPU kernel that mgpu's checks run. While
mgpu infers a call, the check is ATen's own, and its warning is held with
the call's other warnings, so that the call warns once, as eager does.
Everywhere else (meta tensors, fake tensors, symbolic tracing) the original
is called with the arguments it was given, from a C++ wrapper that adds no
Python frame (a warning's stacklevel names the same line)."""
import importlib

import torch

from . import _C

_CHECK_MODULES = ("torch._prims_common.wrappers", "torch._meta_registrations")
_wrappers = set()  # ids of the wrappers installed (a second install() keeps them)


def _install(owner, name, wrap) -> None:
    original = getattr(owner, name, None)
    if original is None or id(original) in _wrappers:
        return
    wrapper = wrap(original)
    _wrappers.add(id(wrapper))
    setattr(owner, name, wrapper)


def install() -> None:
    for module in _CHECK_MODULES:
        _install(importlib.import_module(module), "_resize_output_check", _C._wrap_resize_output_check)
    _install(torch, "_resize_output_", _C._wrap_resize_output_)
