"""The backward of an mgpu graph runs on the thread that calls it.

PyTorch's autograd engine runs the nodes of a device other than the CPU on
a thread of its own per device index (the CPU's run on the calling thread).
For mgpu that thread runs the backward's kernels at their call (or records
them) while the calling thread waits: its kernels start an OpenMP team of
their own beside the calling thread's. With two teams the process has more
OpenMP threads than cores, and libgomp then stops spinning between parallel
regions: every later multithreaded kernel, forward or backward, pays for
waking its team. On 2 cores a GPT-style training step at the call with two
threads took 19.5 ms (forward 5.0, backward 9.5, Adam 5.0) where eager with
two threads took 9.7; with its backward on the calling thread, 10.7 (3.5,
5.5, 1.8).

So a backward whose roots are mgpu tensors runs as
`torch.autograd.set_multithreading_enabled(False)` runs it, on the calling
thread; any other backward is left as PyTorch runs it. The engine object
that `backward()`, `torch.autograd.grad()` and the callbacks of DDP and
FSDP reach (`Variable._execution_engine`) is wrapped; everything but
`run_backward` goes to PyTorch's own.
"""
import torch
from torch.autograd.variable import Variable


def _on_mgpu(roots) -> bool:
    # Roots are tensors or GradientEdges (a node's output: no device to read).
    return any(isinstance(r, torch.Tensor) and r.device.type == "mgpu" for r in roots)


class _Engine:
    """PyTorch's engine; a backward from mgpu roots on the calling thread."""

    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, roots, *args, **kwargs):
        if _on_mgpu(roots):
            with torch.autograd.set_multithreading_enabled(False):
                return self._engine.run_backward(roots, *args, **kwargs)
        return self._engine.run_backward(roots, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def install() -> None:
    if not isinstance(Variable._execution_engine, _Engine):
        Variable._execution_engine = _Engine(Variable._execution_engine)
