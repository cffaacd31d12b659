"""The simulator's figures: ragged fork-join graphs planned for 2, 4 and 8
virtual devices (auto against heft, against the lower bound), the time to
plan a 10,000-node graph, and the workloads planned for 1 to 8 GPUs of a
built-in profile (the GPU cost model). Nothing runs: graphs are recorded,
simulated, dropped."""
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


GPU_COUNTS = (1, 2, 4, 8)
GPU_STREAMS = 2


def gpu_report(cases, profile="h100"):
    """Each case recorded on mgpu (not run) and planned for 1, 2, 4, 8 GPUs
    of `profile` with GPU_STREAMS streams each: predicted seconds and the
    lower bound, against one GPU with one stream. Plus d2l's figure."""
    saved_async = torch_mgpu.async_ops()
    torch_mgpu.set_async_ops(0)
    rows = []
    try:
        for case in cases:
            out = case.fn(*case.make("mgpu"))
            if torch_mgpu.pending_ops() == 0:
                continue
            base = torch_mgpu.simulate(devices=1, lanes_per_device=1, device=profile)
            per = [torch_mgpu.simulate(devices=k, lanes_per_device=GPU_STREAMS, device=profile) for k in GPU_COUNTS]
            rows.append((case.workload, case.name, base.makespan, [(s.makespan, s.lower_bound) for s in per]))
            del out
        d2l = d2l_figures()
    finally:
        torch_mgpu.set_async_ops(saved_async)
    return profile, rows, d2l


def d2l_figures():
    """d2l's automatic-parallelism figures on V100s: 50 products of a
    4000x4000 matrix, one run 0.50 s; two runs on two GPUs 0.50 s."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4000, 4000, generator=g).to("mgpu") for _ in range(2)]
    one = [xs[0].mm(xs[0]) for _ in range(50)]
    alone = torch_mgpu.simulate(devices=1, lanes_per_device=1, device="v100").makespan
    two = [xs[1].mm(xs[1]) for _ in range(50)]
    both_two_gpus = torch_mgpu.simulate(devices=2, lanes_per_device=1, device="v100").makespan
    both_one_gpu = torch_mgpu.simulate(devices=1, lanes_per_device=2, device="v100").makespan
    del one, two
    return alone, both_two_gpus, both_one_gpu


def gpu_markdown(report):
    profile, rows, (alone, two_gpus, one_gpu) = report
    figures = torch_mgpu.device_profiles()[profile]
    head = " | ".join(f"{k} GPU{'s' if k > 1 else ''} (bound)" for k in GPU_COUNTS)
    lines = ["## Predicted on GPUs", "",
             f"Each workload recorded on mgpu and planned, not run, for 1 to 8 {profile} GPUs ({figures['description']})",
             f"with {GPU_STREAMS} streams each (`torch_mgpu.simulate(devices=K, lanes_per_device={GPU_STREAMS}, "
             f"device=\"{profile}\")`).",
             "Speed-up over one GPU with one stream; in brackets the lower bound's speed-up (critical path; the",
             "devices' time, a device's streams sharing its SMs; or the lanes' launches). Predictions of the model,",
             "not measurements.",
             "", f"| workload | case | 1 GPU, 1 stream (ms) | {head} |", "|---|---|---|" + "---|" * len(GPU_COUNTS)]
    for workload, name, base, per in rows:
        cells = " | ".join(f"{base / m:.2f}x ({base / lb:.2f}x)" for m, lb in per)
        lines.append(f"| {workload} | {name} | {base * 1e3:.3f} | {cells} |")
    lines += ["", "d2l's automatic-parallelism example on the v100 profile (its figures: 0.50 s for one run of 50",
              "products of a 4000x4000 matrix, 0.50 s for two runs on two GPUs together): predicted "
              f"{alone:.2f} s alone, {two_gpus:.2f} s for two runs on two GPUs, {one_gpu:.2f} s for two runs on the",
              "two streams of one GPU (each product fills the device: no overlap).", ""]
    return "\n".join(lines)
