"""Out= resize warnings of PyTorch's Python Meta kernels under mgpu.

mgpu infers a call's results by running its Meta kernel. Many of those are
Python (torch._meta_registrations, most through torch._prims_common.wrappers'
out= wrapper), and their check that an out= tensor with elements is being
resized warns through Python's `warnings` at once (with a text of its own,
or through a torch function that hands ATen's warning to Python on return),
beside the warning of the CPU kernel that mgpu's checks run. While mgpu infers
a call, the check is ATen's own, and its warning is held with the call's
other warnings, so that the call warns once, as eager does. Everywhere else
(meta tensors, fake tensors) these functions are PyTorch's, unchanged."""
import functools
import importlib

import torch

from . import _C

_CHECK_MODULES = ("torch._prims_common.wrappers", "torch._meta_registrations")


def _wrapped(fn, wrapper):
    if getattr(fn, "_mgpu", False):
        return fn
    wrapper = functools.wraps(fn)(wrapper)
    wrapper._mgpu = True
    return wrapper


def _check_under_mgpu(check):
    def resize_output_check(out, shape):
        held = _C._resize_output_check(out, list(shape))
        return check(out, shape) if held is None else held

    return _wrapped(check, resize_output_check)


def _resize_under_mgpu(resize):
    def _resize_output_(out, size, device):
        if _C._resize_output(out, list(size), torch.device(device)):
            return out
        return resize(out, size, device)

    return _wrapped(resize, _resize_output_)


def install() -> None:
    for name in _CHECK_MODULES:
        module = importlib.import_module(name)
        check = getattr(module, "_resize_output_check", None)
        if check is not None:
            module._resize_output_check = _check_under_mgpu(check)
    resize = getattr(torch, "_resize_output_", None)
    if resize is not None:
        torch._resize_output_ = _resize_under_mgpu(resize)
