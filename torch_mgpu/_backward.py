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

So a backward that may reach mgpu nodes runs as
`torch.autograd.set_multithreading_enabled(False)` runs it, on the calling
thread: one whose roots or inputs are mgpu tensors (or GradientEdges of
mgpu outputs), and, where no CUDA device is present (no other device has a
thread to lose), every backward: a loss computed on the host from mgpu
values (`(h.cpu() ** 2).sum()`) has host roots over an mgpu graph. Any
other backward is left as PyTorch runs it. The engine object that
`backward()`, `torch.autograd.grad()` and the callbacks of DDP and FSDP
reach (`Variable._execution_engine`) is wrapped; everything but
`run_backward` goes to PyTorch's own. TorchScript's and LibTorch's
backward call the C++ engine directly and keep autograd's device thread.
"""
import torch
from torch.autograd.variable import Variable

_no_cuda = None  # whether no CUDA device is present (known at the first backward)


def _mgpu_value(r) -> bool:
    if isinstance(r, torch.Tensor):
        return r.device.type == "mgpu"
    node = getattr(r, "node", None)  # a GradientEdge: its node's output metadata
    try:
        return node._input_metadata[r.output_nr].device.type == "mgpu"
    except (AttributeError, IndexError, TypeError):
        return False


def _reaches_mgpu(roots, inputs) -> bool:
    global _no_cuda
    if _no_cuda is None:
        _no_cuda = not torch.cuda.is_available()
    if _no_cuda:
        return True
    return any(_mgpu_value(r) for r in tuple(roots) + tuple(inputs or ()))


class _Engine:
    """PyTorch's engine; a backward that may reach mgpu on the calling thread."""

    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        # run_backward(tensors, grad_tensors, keep_graph, create_graph, inputs, ...)
        roots = args[0] if args else kwargs.get("tensors", ())
        inputs = args[4] if len(args) > 4 else kwargs.get("inputs", ())
        if _reaches_mgpu(roots, inputs):
            with torch.autograd.set_multithreading_enabled(False):
                return self._engine.run_backward(*args, **kwargs)
        return self._engine.run_backward(*args, **kwargs)

    def __getattr__(self, name):
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)


def install() -> None:
    if not isinstance(Variable._execution_engine, _Engine):
        Variable._execution_engine = _Engine(Variable._execution_engine)
