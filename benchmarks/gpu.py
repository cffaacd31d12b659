"""The GPU benchmarks (run by `bash scripts/dev.sh gpu` on a machine with CUDA):
eager CUDA, torch.compile (inductor, and its CUDA graphs: reduce-overhead)
and mgpu with 1, 2 and 4 streams per GPU, without and with replay (CUDA
graphs over the streams), measured in one round-robin per case, with the planner's predicted
makespan beside the measured one. Writes benchmarks/RESULTS-gpu.md.

    python benchmarks/gpu.py                # on a CUDA machine
    python benchmarks/gpu.py --device cpu   # the same run on CPU lanes (a dry run of the script)
"""
import argparse
import datetime
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import torch_mgpu  # noqa: E402
import bench_branches  # noqa: E402
import bench_data_parallel  # noqa: E402
import bench_kernels  # noqa: E402
from common import Case, gen  # noqa: E402


def d2l_case(size, products):
    """The seed's d2l code: two independent runs of `products` products of
    size x size matrices, then a synchronize."""
    def make(device):
        g = gen(7)
        return [torch.rand(size, size, generator=g).to(device) for _ in range(2)]

    def fn(x1, x2):
        r1 = [x1.mm(x1) for _ in range(products)]
        r2 = [x2.mm(x2) for _ in range(products)]
        return r1 + r2  # every product is kept, as in the seed

    return Case("d2l", f"2 runs x {products} mm {size}", make, fn, reps=5)


def cases(quick, device):
    # On a GPU every case but the 4000x4000 products keeps the size the
    # goals name in --quick too (each runs in milliseconds there).
    big = device == "cuda" and not quick
    quick = quick and device != "cuda"
    out = [d2l_case(4000 if big else 256, 50 if big else 8)]
    out += [c for c in bench_branches.cases(quick) if c.name in {"8 branches 256", "4 branches 512", "8 branches 512", "2 branches 1024"}]
    out += bench_data_parallel.cases(quick)
    out += [c for c in bench_kernels.cases(quick) if c.name.startswith("GP")]
    return out


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(variants, reps, warmup=3, settle=False):
    """variants: name -> (run, enter); `enter` runs untimed before each run.
    `settle` (mgpu): warm-up runs until the hot graph's compile (tier 1, in
    the background) is done and its trial has chosen, as a loop's steady
    state (benchmarks/run.py's settle_default): a compile holds the
    interpreter while it traces, which stalls whatever is timed beside it
    (this variant, the next case's eager)."""
    for run, enter in variants.values():
        for k in range(warmup + 14 if settle else warmup):
            enter()
            run()
            # (A lent GPU machine's call is 10 minutes.)
            if settle and k >= 1 and not torch_mgpu.wait_for_compiles(120):
                raise RuntimeError("a background compile did not finish in 120 s")
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, (run, enter) in variants.items():
            enter()
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in flat(e)]
    return []


def nothing():
    pass


def physical_devices(device):
    if device == "cuda":
        return [f"cuda:{k}" for k in range(torch.cuda.device_count())]
    return ["cpu"]


def run_case(case, device, streams, with_compile, quick=False):
    phys_in = case.make(device)
    ref = case.fn(*case.make("cpu"))
    variants = {"eager": (lambda: (case.fn(*phys_in), sync(device)), nothing)}
    if with_compile and case.compile_ok:
        compiled = torch.compile(case.fn)
        compiled(*phys_in)
        variants["compile"] = (lambda: (compiled(*phys_in), sync(device)), nothing)
        if device == "cuda":
            # Inductor's CUDA graphs (one stream): a result is overwritten
            # by the next call, which nobody here reads.
            reduced = torch.compile(case.fn, mode="reduce-overhead")
            reduced(*phys_in)
            variants["reduce-overhead"] = (lambda: (reduced(*phys_in), sync(device)), nothing)
    mg_in = case.make("mgpu")
    plans, replays = {}, {}
    compile_hits = torch_mgpu._C._tier_compile_hits()
    for s in streams:
        for replay in (False, True):
            def configure(s=s, replay=replay):
                # Replay of the hot graph after 2 syncs, every run (no
                # trial): on a GPU's streams a CUDA graph launch. Tier 1
                # off there: replay runs the graph, and its compiles would
                # only take the lent machine's minutes.
                torch_mgpu.configure(devices=physical_devices(device), lanes_per_device=s,
                                     compile=0 if replay else compile_hits)
                torch_mgpu._C._set_replay_hits(2 if replay else 0)
                torch_mgpu._C._set_replay_trial(False)

            def run_mgpu(s=s, replay=replay):
                out = case.fn(*mg_in)  # kept: a result nobody holds is never computed
                torch_mgpu.synchronize()
                del out
                p = torch_mgpu.last_plan()
                if replay:
                    replays[s] = p.replay or "-"
                else:
                    plans.setdefault(s, []).append((p.predicted_makespan, p.measured_makespan, p.lanes_used))
            variants[f"mgpu x{s}" + (" replay" if replay else "")] = (run_mgpu, configure)
    # Eager and compiled code round-robin; each lane configuration in a block
    # of its own (configuring lanes between runs would drop their plans).
    times = measure({k: v for k, v in variants.items() if not k.startswith("mgpu")}, case.reps)
    hits, trial = torch_mgpu._C._replay_hits(), torch_mgpu._C._replay_trial()
    split = {}
    try:
        for name in [k for k in variants if k.startswith("mgpu")]:
            run, configure = variants[name]
            configure()
            times.update(measure({name: (run, nothing)}, case.reps, settle=True))
            split[name] = host_split(case, mg_in)
    finally:
        torch_mgpu._C._set_replay_hits(hits)
        torch_mgpu._C._set_replay_trial(trial)
    # Correctness of what was timed: every mgpu configuration (replayed
    # too) against eager CPU.
    for s in streams:
        for replay in (False, True):
            variants[f"mgpu x{s}" + (" replay" if replay else "")][1]()
            try:
                for _ in range(4 if replay else 1):
                    got_all = flat(case.fn(*mg_in))
                    for got, want in zip(got_all, flat(ref)):
                        scale = max(1.0, float(want.abs().max()))
                        torch.testing.assert_close(got.cpu(), want, rtol=2e-3, atol=2e-3 * scale)
            finally:
                torch_mgpu._C._set_replay_hits(hits)
                torch_mgpu._C._set_replay_trial(trial)
    torch_mgpu.configure(compile=compile_hits)  # as it was (the replay variants turn tier 1 off)
    pred = {s: statistics.median(p for p, _, _ in plans[s]) for s in streams}
    meas = {s: statistics.median(m for _, m, _ in plans[s]) for s in streams}
    lanes = {s: max(l for _, _, l in plans[s]) for s in streams}
    return times, pred, meas, lanes, replays, split


SYNC_PARTS = ("sync_graph_us", "sync_plan_us", "sync_execute_us", "sync_bind_us")


def host_split(case, mg_in):
    """Where a settled mgpu run's time goes, in ms per run (medians of the
    capture and the sync; the sync's parts from stats(), means): the
    capture of the ops at their calls, then the sync's graph, plan, run
    (or replay) and binding of results."""
    before = torch_mgpu.stats()
    capture, whole = [], []
    for _ in range(case.reps):
        t0 = time.perf_counter()
        out = case.fn(*mg_in)
        t1 = time.perf_counter()
        torch_mgpu.synchronize()
        t2 = time.perf_counter()
        del out
        capture.append(t1 - t0)
        whole.append(t2 - t1)
    after = torch_mgpu.stats()
    parts = {k: (after[k] - before[k]) / case.reps / 1e3 for k in SYNC_PARTS}
    return {"capture": statistics.median(capture) * 1e3, "sync": statistics.median(whole) * 1e3, **parts}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS-gpu.md"))
    a = ap.parse_args()
    device = a.device
    streams = [1, 2, 4] if device == "cuda" else [1, 2]
    before = torch_mgpu.configuration()
    t_start = time.time()
    rows = []
    todo = cases(a.quick, device)
    for case in todo:
        times, pred, meas, lanes, replays, split = run_case(case, device, streams, not a.no_compile, a.quick)
        rows.append((case, times, pred, meas, lanes, replays, split))
        line = "  ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items())
        print(f"{case.workload:>14} | {case.name:<28} {line}", flush=True)
        # Written after each case: a run cut short (a lent machine's time
        # limit) leaves the rows it measured.
        write(a, device, streams, rows, len(todo), t_start)
    torch_mgpu.configure(**before)
    print(f"wrote {a.out}")


def write(a, device, streams, rows, cases_in_all, t_start):
    if device == "cuda":
        name = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        name = f"CPU lanes ({os.cpu_count()} cores), a dry run"
    head = [
        "# GPU benchmark results",
        "",
        f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"- device: {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); {platform.machine()}",
        f"- mode: {'quick' if a.quick else 'full'}; {time.time() - t_start:.0f} s" +
        (f" (cut short: {len(rows)} of {cases_in_all} cases)" if len(rows) < cases_in_all else ""),
        "",
        "Times in ms, medians after warm-up; eager and torch.compile timed round-robin, each mgpu configuration in a",
        "block of its own right after them. `mgpu xS`: mgpu with S",
        "streams (lanes) per device, inputs already on the device after the first run (a value's device copy is",
        "kept), results left on the device. `pred/meas`: the planner's predicted makespan over the measured one.",
        "`reduce-overhead`: torch.compile with inductor's CUDA graphs (one stream; CUDA only).",
        "`mgpu xS replay`: the same with replay on (the hot graph recorded after 2 syncs and replayed every run",
        "after, no trial: on a GPU's streams one launch of a CUDA graph captured from the recording); `replay`",
        "says how the last run replayed (or why not: host lanes are never replayed).",
        "",
    ]
    cols = (["eager"] + (["compile"] if not a.no_compile else []) +
            (["reduce-overhead"] if device == "cuda" and not a.no_compile else []) +
            [f"mgpu x{s}" + r for s in streams for r in ("", " replay")])
    table = ["| workload | case | " + " | ".join(cols) + " | " +
             " | ".join(f"x{s} speed-up, lanes used, pred/meas | x{s} replay speed-up" for s in streams) + " | replay |",
             "|" + "---|" * (3 + len(cols) + 2 * len(streams))]
    for case, times, pred, meas, lanes, replays, _ in rows:
        cells = [f"{times[c] * 1e3:.3f}" if c in times else "-" for c in cols]
        extra = [f"{times['eager'] / times[f'mgpu x{s}']:.2f}x, {lanes[s]}, {pred[s] / meas[s]:.2f} | "
                 f"{times['eager'] / times[f'mgpu x{s} replay']:.2f}x" for s in streams]
        how = "; ".join(f"x{s}: {replays.get(s, '-')}" for s in streams)
        table.append(f"| {case.workload} | {case.name} | " + " | ".join(cells + extra) + f" | {how} |")
    table += [
        "",
        "## Where an mgpu run's time goes",
        "",
        "ms per run, after the timed runs above, settled: `capture` the ops recorded at their calls (median),",
        "`sync` the sync (median), and of the sync (means, from `stats()`): `graph` building the graph, `plan`",
        "planning it (a cached plan's lookup), `run` running it (or replaying it), `bind` binding its results.",
        "",
        "| workload | case | mgpu | capture | sync | graph | plan | run | bind |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, _, _, _, _, _, split in rows:
        for name, sp in split.items():
            table.append(f"| {case.workload} | {case.name} | {name} | {sp['capture']:.3f} | {sp['sync']:.3f} | " +
                         " | ".join(f"{sp[k]:.3f}" for k in SYNC_PARTS) + " |")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(head + table) + "\n")


if __name__ == "__main__":
    main()
