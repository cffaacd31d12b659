"""Workload 6: a linear chain of 1,000 small elementwise ops (pure overhead)."""
import torch

from common import Case, gen


def chain(x):
    for _ in range(500):
        x = x * 1.0001
        x = x + 0.0001
    return x


def cases(quick):
    def make(device):
        return (torch.randn(64, generator=gen(8)).to(device),)
    return [Case("chain", "1000 small ops", make, chain, None, reps=5 if quick else 9)]
