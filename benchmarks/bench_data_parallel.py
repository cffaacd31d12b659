"""Workload 3: data parallelism by hand: one expensive function on each shard."""
from typing import List

import torch

from common import Case, gen


def expensive(x, w1, w2):
    h = torch.relu(x @ w1)
    h = torch.relu(h @ w2)
    return torch.softmax(h @ w2.t(), dim=-1)


def sharded(shards, w1, w2):
    return torch.cat([expensive(s, w1, w2) for s in shards])


@torch.jit.script
def _expensive_ts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ w1)
    h = torch.relu(h @ w2)
    return torch.softmax(h @ w2.t(), dim=-1)


@torch.jit.script
def sharded_fork(shards: List[torch.Tensor], w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    futs = [torch.jit.fork(_expensive_ts, s, w1, w2) for s in shards]
    return torch.cat([torch.jit.wait(f) for f in futs])


def cases(quick):
    shards, rows, d = (4, 64, 128) if quick else (8, 256, 256)
    def make(device):
        g = gen(3)
        return ([torch.randn(rows, d, generator=g).to(device) for _ in range(shards)],
                torch.randn(d, d, generator=g).to(device), torch.randn(d, d, generator=g).to(device))
    return [Case("data_parallel", f"{shards} shards of {rows}x{d}", make, sharded, sharded_fork)]
