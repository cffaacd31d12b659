"""Workload 2: a sum of independent branches F = sum_i f_i(A_i @ B_i)."""
from typing import List

import torch

from common import Case, gen


def branch(a, b):
    return torch.tanh(a @ b).mul(0.5).add(0.1).relu()


def branches(As, Bs):
    return sum(branch(a, b) for a, b in zip(As, Bs))


@torch.jit.script
def _branch_ts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a @ b).mul(0.5).add(0.1).relu()


@torch.jit.script
def branches_fork(As: List[torch.Tensor], Bs: List[torch.Tensor]) -> torch.Tensor:
    futs = [torch.jit.fork(_branch_ts, As[i], Bs[i]) for i in range(len(As))]
    out = torch.jit.wait(futs[0])
    for f in futs[1:]:
        out = out + torch.jit.wait(f)
    return out


def cases(quick):
    grid = [(8, 128), (8, 256), (4, 512)] if quick else [
        (2, 64), (4, 128), (8, 128), (8, 256), (16, 128), (16, 256), (4, 512), (8, 512), (2, 1024)]
    out = []
    for k, n in grid:
        def make(device, k=k, n=n):
            g = gen(k * 1000 + n)
            As = [torch.randn(n, n, generator=g).to(device) for _ in range(k)]
            Bs = [torch.randn(n, n, generator=g).to(device) for _ in range(k)]
            return As, Bs
        out.append(Case("branches", f"{k} branches {n}", make, branches, branches_fork))
    return out
