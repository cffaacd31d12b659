"""Workload 6: linear chains of 1,000 small ops (pure overhead).

`chain` is elementwise arithmetic, which mgpu fuses into one pass per lane;
`chain_unfused` alternates a multiply with tanh, so nothing fuses and every
op runs as its own call (the per-op cost of capture and execution)."""
import torch

from common import Case, gen


def chain(x):
    for _ in range(500):
        x = x * 1.0001
        x = x + 0.0001
    return x


def chain_unfused(x):
    for _ in range(500):
        x = torch.tanh(x * 1.0001)
    return x


def cases(quick):
    def make(device):
        return (torch.randn(64, generator=gen(8)).to(device),)
    return [Case("chain", "1000 small ops", make, chain, None, reps=5 if quick else 9),
            Case("chain", "1000 small ops, unfusable", make, chain_unfused, None, reps=5 if quick else 9)]
