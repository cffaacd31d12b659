"""Workload 4: kernel methods: an RBF Gaussian-process kernel with several
length-scales, k-nearest neighbours over query blocks, one GMM EM step."""
from typing import List

import torch

from common import Case, gen


def rbf_kernels(x, scales):
    d2 = (x * x).sum(1, keepdim=True) - 2 * x @ x.t() + (x * x).sum(1)
    return [torch.exp(-d2 / (2 * s * s)) for s in scales]


def gp_heads(x, y, scales_t):
    # One GP posterior mean per length-scale: K^-1 y through a Cholesky solve.
    outs = []
    for i in range(scales_t.shape[0]):
        s = scales_t[i]
        d2 = (x * x).sum(1, keepdim=True) - 2 * x @ x.t() + (x * x).sum(1)
        k = torch.exp(-d2 / (2 * s * s)) + 1e-2 * torch.eye(x.shape[0], device=x.device)
        outs.append(k @ torch.cholesky_solve(y, torch.linalg.cholesky(k)))
    return outs


def knn(db, queries, k: int = 8):
    outs = []
    for q in queries:
        d = torch.cdist(q, db)
        outs.append(d.topk(k, largest=False).indices)
    return outs


def gmm_em_step(x, means, log_vars, log_weights):
    # E step over components (independent), then M step.
    logps = []
    for j in range(means.shape[0]):
        diff = x - means[j]
        logps.append(log_weights[j] - 0.5 * ((diff * diff) / log_vars[j].exp() + log_vars[j]).sum(1))
    logp = torch.stack(logps, 1)
    resp = torch.softmax(logp, 1)
    nk = resp.sum(0) + 1e-6
    new_means = (resp.t() @ x) / nk[:, None]
    return new_means, nk


@torch.jit.script
def _knn_one(q: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
    return torch.cdist(q, db).topk(8, largest=False).indices


@torch.jit.script
def knn_fork(db: torch.Tensor, queries: List[torch.Tensor]) -> List[torch.Tensor]:
    futs = [torch.jit.fork(_knn_one, q, db) for q in queries]
    return [torch.jit.wait(f) for f in futs]


def cases(quick):
    n, d = (256, 16) if quick else (1024, 32)
    def make_gp(device):
        g = gen(4)
        return (torch.randn(n, d, generator=g).to(device), torch.randn(n, 1, generator=g).to(device),
                torch.tensor([0.5, 1.0, 2.0, 4.0]).to(device))
    def make_knn(device):
        g = gen(5)
        return (torch.randn(4 * n, d, generator=g).to(device),
                [torch.randn(n // 2, d, generator=g).to(device) for _ in range(8)])
    def make_gmm(device):
        g = gen(6)
        return (torch.randn(4 * n, d, generator=g).to(device), torch.randn(8, d, generator=g).to(device),
                torch.zeros(8, d).to(device), torch.full((8,), -2.079).to(device))
    return [
        Case("kernels", f"GP 4 length-scales n={n}", make_gp, gp_heads, None),
        Case("kernels", f"kNN 8 query blocks n={n}", make_knn, knn, knn_fork),
        Case("kernels", f"GMM EM step 8 comps n={4 * n}", make_gmm, gmm_em_step, None),
    ]
