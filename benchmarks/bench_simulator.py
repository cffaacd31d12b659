"""The simulator's figures: ragged fork-join graphs planned for 2, 4 and 8
virtual devices (auto against heft, against the lower bound), and the time to
plan a 10,000-node graph. Nothing runs: graphs are recorded, simulated, dropped."""
import torch

import torch_mgpu


def fork_join(widths, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, size, generator=g).to("mgpu")
    for stage, width in enumerate(widths):
        outs = []
        for b in range(width):
            y = x
            for _ in range(1 + (b * 7 + stage) % 4):  # ragged branch lengths
                y = torch.tanh(y @ x)
            outs.append(y)
        x = torch.stack(outs).mean(0)
    return x


def report(quick):
    # Graphs are recorded whole, then simulated: no background execution.
    saved_async = torch_mgpu.async_ops()
    torch_mgpu.set_async_ops(0)
    try:
        return _report(quick)
    finally:
        torch_mgpu.set_async_ops(saved_async)


def _report(quick):
    rows = []
    size = 128 if quick else 256
    for devices in (2, 4, 8):
        out = fork_join([devices * 2, devices * 3 + 1, devices * 2], size)
        a = torch_mgpu.simulate(devices=devices, lanes_per_device=1, policy="auto")
        h = torch_mgpu.simulate(devices=devices, lanes_per_device=1, policy="heft")
        rows.append((devices, len(a.plan), a.makespan, h.makespan, a.lower_bound))
        del out
        torch_mgpu.synchronize()
    # Planning a 10,000-node graph: 2,000 independent 5-op branches, planned
    # at a sync on the configured lanes (the sync's plan phase, a cache miss).
    x = torch.randn(8, 8).to("mgpu")
    outs = [torch.tanh(x * (1.0 + i)).add(1.0).mul(0.5).relu() for i in range(2000)]
    n_nodes = torch_mgpu.pending_ops()
    before = torch_mgpu.stats()
    torch_mgpu.synchronize()
    after = torch_mgpu.stats()
    assert after["plans_built"] == before["plans_built"] + 1
    plan_s = (after["sync_plan_us"] - before["sync_plan_us"]) * 1e-6
    del outs
    return rows, (n_nodes, plan_s)


def markdown(rows, planning):
    lines = ["## Simulator", "",
             "Ragged fork-join graphs (three stages of uneven branches, each a chain of `tanh(y @ x)`),",
             "planned for K virtual devices with one lane each. Seconds from the calibrated cost model.", "",
             "| devices | nodes | auto makespan (ms) | heft makespan (ms) | lower bound (ms) | auto / bound | auto / heft |",
             "|---|---|---|---|---|---|---|"]
    for d, n, a, h, lb in rows:
        lines.append(f"| {d} | {n} | {a * 1e3:.3f} | {h * 1e3:.3f} | {lb * 1e3:.3f} | {a / lb:.3f} | {a / h:.3f} |")
    n, secs = planning
    lanes = len(torch_mgpu.lanes())
    lines += ["", f"Planning a {n}-node graph at a sync ({lanes} lanes, policy {torch_mgpu.policy()}: serial, chain",
              f"clustering and HEFT candidates, each simulated): {secs * 1e3:.1f} ms.", ""]
    return "\n".join(lines)
