"""Shared pieces of the benchmark suite: a Case and the scripted fork helper."""
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class Case:
    """One workload at one size. `make(device)` builds the inputs; `fn(*inputs)`
    is the ordinary PyTorch code; `fork(*inputs)` (optional) is the same work
    with torch.jit.fork/wait over its branches; `grad` marks fwd+bwd cases."""
    workload: str
    name: str
    make: Callable
    fn: Callable
    fork: Optional[Callable] = None
    compile_ok: bool = True
    reps: int = 7
    notes: str = ""
    extra: dict = field(default_factory=dict)


def tree_map(fn, x):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(tree_map(fn, e) for e in x)
    return x


def gen(seed=0):
    return torch.Generator().manual_seed(seed)
