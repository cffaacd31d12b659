"""Workload 1: the matrix-product loop on two devices, run(x) = [x @ x for _ in range(50)]
on two inputs. Eager users write run(x1); run(x2) and hope for overlap."""
from typing import List

import torch

from common import Case, gen


def run(x):
    return [x @ x for _ in range(50)]


def both(x1, x2):
    return run(x1) + run(x2)


@torch.jit.script
def _run_ts(x: torch.Tensor) -> List[torch.Tensor]:
    return [x @ x for _ in range(50)]


@torch.jit.script
def both_fork(x1: torch.Tensor, x2: torch.Tensor) -> List[torch.Tensor]:
    f = torch.jit.fork(_run_ts, x1)
    b = _run_ts(x2)
    return torch.jit.wait(f) + b


def cases(quick):
    n = 128 if quick else 448  # 448: about a second for 100 products on one core here
    def make(device):
        g = gen(1)
        return (torch.randn(n, n, generator=g).to(device), torch.randn(n, n, generator=g).to(device))
    return [Case("matmul_loop", f"2x50 mm {n}", make, both, both_fork, reps=3 if not quick else 5)]
