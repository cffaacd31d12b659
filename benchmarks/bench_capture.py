"""Workload 7: capture overhead, microseconds per recorded op on tiny tensors,
and per view (reported per op: the runner divides by `ops`)."""
import torch

from common import Case, gen


def ops(x):
    y = x
    for _ in range(250):
        y = y + x
        y = y * x
        y = y.relu()
        y = y - 0.5
    return y


def views(x):
    y = x
    for _ in range(250):
        y = y.t()
        y = y.unsqueeze(0)
        y = y.squeeze(0)
        y = y.t()
    return y


def cases(quick):
    def make(device):
        return (torch.randn(8, generator=gen(9)).to(device),)

    def make_matrix(device):
        return (torch.randn(4, 2, generator=gen(9)).to(device),)
    return [Case("capture", "1000 tiny ops", make, ops, None, compile_ok=False, extra={"ops": 1000, "capture_only": True}),
            Case("capture", "1000 views", make_matrix, views, None, compile_ok=False,
                 extra={"ops": 1000, "capture_only": True})]
