"""Workload 8: many small independent feature transforms (64 features of
2,048 rows, about 16 small ops each: standardize, clip, and a few
elementwise maps), the preprocessing of a tabular model. Each feature's
chain is independent of the others; every op is small, so the per-op cost
of the executor matters as much as the spread."""
from typing import List

import torch

from common import Case, gen


def feature(c):
    mu = c.mean()
    sd = c.std() + 1e-6
    z = ((c - mu) / sd).clamp(-3.0, 3.0)
    return torch.log1p(z.abs()) + torch.tanh(z * 0.5) * torch.sigmoid(z) - z * z * 0.1


def features(cols):
    return torch.stack([feature(c) for c in cols], 1)


@torch.jit.script
def _feature_ts(c: torch.Tensor) -> torch.Tensor:
    mu = c.mean()
    sd = c.std() + 1e-6
    z = ((c - mu) / sd).clamp(-3.0, 3.0)
    return torch.log1p(z.abs()) + torch.tanh(z * 0.5) * torch.sigmoid(z) - z * z * 0.1


@torch.jit.script
def features_fork(cols: List[torch.Tensor]) -> torch.Tensor:
    futs = [torch.jit.fork(_feature_ts, c) for c in cols]
    return torch.stack([torch.jit.wait(f) for f in futs], 1)


def cases(quick):
    def make(device):
        g = gen(64)
        return ([(torch.randn(2048, generator=g) * (1 + j % 5) + j).to(device) for j in range(64)],)
    return [Case("features", "64 features x 16 ops, 2048 rows", make, features, features_fork,
                 reps=5 if quick else 9)]
