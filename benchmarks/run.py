"""Runs every workload with every baseline and reports. Eager with one
thread, jit.fork and mgpu's default configuration each run in a child
process per case (CHILD_VARIANTS); the rest in this process.

    python benchmarks/run.py            # full suite: table, RESULTS.md, speedup.png
    python benchmarks/run.py --quick    # a few seconds (CI): writes under benchmarks/out/

Baselines, measured in the same run: eager PyTorch (default threads), eager
with one thread, torch.compile (inductor; full mode), torch.jit.fork/wait over
the branches (where the workload has branches), mgpu with the default lanes,
and the simulator's predicted execution time for the same lanes. Times are
medians of several repetitions after warm-up, with min..max; memory is the
growth of peak RSS over the steady state during the timed runs.
"""
import argparse
import copy
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# numpy's OpenBLAS threads (numpy comes with torch) spin on the cores that the
# baselines and the lanes need; no baseline uses numpy's BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

import torch_mgpu  # noqa: E402
import bench_branches  # noqa: E402
import bench_capture  # noqa: E402
import bench_chain  # noqa: E402
import bench_data_parallel  # noqa: E402
import bench_features  # noqa: E402
import bench_inception  # noqa: E402
import bench_kernels  # noqa: E402
import bench_matmul_loop  # noqa: E402
import bench_simulator  # noqa: E402
import bench_training  # noqa: E402
from common import tree_map  # noqa: E402

MODULES = [bench_matmul_loop, bench_branches, bench_data_parallel, bench_kernels, bench_inception,
           bench_chain, bench_features, bench_training, bench_capture]


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def nothing():
    pass


# Idle time before each timed run: threads the run before left spinning
# (an OpenMP team's workers, mgpu's lanes: each spins a while before it
# sleeps) would otherwise take the core (on this machine, the hyperthread)
# the next variant runs on, and charge one variant for another's threads.
SETTLE_S = 0.003


def measure_interleaved(variants, reps, warmup=5):
    """Times every variant `reps` times, round-robin (eager, mgpu, eager,
    mgpu, ...), so that a change in the machine's speed during a case hits
    all variants alike, each run after SETTLE_S idle; then each variant's
    peak RSS in a run of its own. `variants`: name -> (run, enter, leave);
    enter/leave run untimed around each run (e.g. setting the thread
    count)."""
    for run, enter, leave in variants.values():
        for _ in range(warmup):
            enter()
            run()
            leave()
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, (run, enter, leave) in variants.items():
            enter()
            time.sleep(SETTLE_S)
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
            leave()
    out = {}
    for name, (run, enter, leave) in variants.items():
        base = rss_kib("VmRSS")
        can_reset = reset_peak()
        enter()
        run()
        leave()
        peak = (rss_kib("VmHWM") - base) / 1024 if can_reset else float("nan")
        ts = times[name]
        out[name] = {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "peak_mib": max(peak, 0.0)}
    return out


PLAN_RATIOS = []


def mgpu_sync(out):
    torch_mgpu.synchronize()
    return out


def record_plan_ratio():
    """Untimed, after each mgpu run: reading the plan is not the workload's
    work."""
    p = torch_mgpu.last_plan()
    if p is not None and p.measured_makespan > 0:
        PLAN_RATIOS.append(p.predicted_makespan / p.measured_makespan)


TIER1_HITS = 2  # configure(compile=...) for the tier-1 variant

# How the default column's runs ran: graphs run (syncs and background
# flights) and those of them that ran compiled code (tier 1).
DEFAULT_WAY = {"graphs": 0, "tier1": 0, "at_call": 0, "runs": 0}


def default_enter():
    DEFAULT_WAY["before"] = torch_mgpu.stats()


def default_leave():
    record_plan_ratio()
    s, b = torch_mgpu.stats(), DEFAULT_WAY.pop("before")
    DEFAULT_WAY["graphs"] += (s["syncs"] - b["syncs"]) + (s["background_flushes"] - b["background_flushes"])
    DEFAULT_WAY["tier1"] += s["tier1_runs"] - b["tier1_runs"]
    DEFAULT_WAY["at_call"] += s["at_call_traces"] - b["at_call_traces"]
    DEFAULT_WAY["runs"] += 1


def default_way():
    """`at the call a/b`: of the b runs of the default column, a ran their
    ops at the call (engine/at_call.h; `trace_choices()` says which way:
    with the caller's threads or one); `tier 1 a/b`: of the b graphs the
    lazy runs synced, a ran compiled code; `tier 0` where none did."""
    g, t1 = DEFAULT_WAY["graphs"], DEFAULT_WAY["tier1"]
    lazy = f"tier 1 {t1}/{g}" if t1 else "tier 0" if g else ""
    at_call = DEFAULT_WAY["at_call"]
    if not at_call:
        return lazy or "tier 0"
    ways = sorted({t["way"] for t in torch_mgpu.trace_choices() if t["way"] != "lazy"})
    one = " (one thread)" if ways == ["at the call, one thread"] else ""
    return f"at the call{one} {min(at_call, DEFAULT_WAY['runs'])}/{DEFAULT_WAY['runs']}" + (f"; {lazy}" if lazy else "")


def tier1_enter():
    # Tier 1 runs foreground syncs only: background execution off, so that
    # a workload is one graph per sync.
    # The lazy way's tier 1: no trace runs at the call.
    tier1_enter.saved = torch_mgpu.async_ops(), torch_mgpu._C._tier_compile_hits(), torch_mgpu._C._at_call()
    torch_mgpu.set_async_ops(0)
    torch_mgpu.configure(compile=TIER1_HITS, at_call="off")


def tier1_leave():
    saved_async, saved_hits, saved_at_call = tier1_enter.saved
    torch_mgpu.configure(compile=saved_hits, at_call=saved_at_call)  # the default's for the mgpu column
    torch_mgpu.set_async_ops(saved_async)


def prepare_tier1(case, mg_in):
    """Runs the workload with tier 1 on until its graphs are compiled and
    their trials decided (untimed): the run at which tier 1 first ran, the
    compile seconds, whether the compiled code was kept."""
    before = torch_mgpu.stats()
    started = None
    tier1_enter()
    try:
        # A graph with branches is compiled two ways (whole, and in parts on
        # the lanes): its trial is a cold and three timed runs of each, in
        # turns with three runs of tier 0.
        for k in range(TIER1_HITS + 14):
            mgpu_sync(case.fn(*mg_in))
            plan = torch_mgpu.last_plan()
            if started is None and plan is not None and plan.tier == 1:
                started = k + 1
            # A graph may get hot later than the hit count (a training
            # step's first steps differ: the optimizer makes its state): the
            # compiles are waited for after every run from then on, so that
            # none runs on during the timed runs.
            if k >= TIER1_HITS - 1 and not torch_mgpu.wait_for_compiles(600):
                return {"mgpu_tier1_error": "compile > 600 s"}
        plan = torch_mgpu.last_plan()
    finally:
        tier1_leave()
    after = torch_mgpu.stats()
    return {"tier1": {"started": started, "kept": plan is not None and plan.tier == 1,
                      "compiled": after["tier1_compiled"] - before["tier1_compiled"],
                      "compile_s": (after["tier1_compile_us"] - before["tier1_compile_us"]) / 1e6,
                      "why": torch_mgpu._C._tier_last_error(),
                      "way": tier1_way(plan)}}


def settle_default(case, mg_in):
    """Runs the workload in the default configuration (tier 1 on, background
    flights, traces tried at the call) until no compile is pending after a
    run and every repeated trace has chosen its way (untimed): the timed
    runs of the `mgpu` column then meet the steady state a loop reaches,
    not the compile thread at work nor a trial. Each run comes after
    SETTLE_S idle, as the timed ones do: the trials measure the ways in the
    rhythm they are timed in (after an idle gap the lanes, the background
    worker and an OpenMP team sleep, and waking them costs the ways that
    use them: 8 branches 128 chose the way at the call with two threads,
    0.70 ms in a loop with no gap, 1.57 ms timed after one, where one
    thread took 0.96)."""
    def run():
        time.sleep(SETTLE_S)
        mgpu_sync(case.fn(*mg_in))

    if torch_mgpu._C._tier_compile_hits():
        for k in range(TIER1_HITS + 14):
            run()
            if k >= TIER1_HITS - 1 and not torch_mgpu.wait_for_compiles(600):
                return
    if torch_mgpu._C._at_call() != "auto":
        return
    runs = {t["trace"]: t["runs"] for t in torch_mgpu.trace_choices()}
    run()
    for _ in range(60):
        # The workload's traces: those that ran since.
        ours = [t for t in torch_mgpu.trace_choices() if t["runs"] > runs.get(t["trace"], 0)]
        if all(t["state"] == "chosen" for t in ours):
            return
        runs = {t["trace"]: t["runs"] for t in torch_mgpu.trace_choices()}
        run()


def tier1_way(plan):
    """How the kept code runs: `whole` or `N parts`, with the times its
    trial measured of each way and of tier 0 (ms)."""
    if plan is None or plan.tier != 1 or not plan.compiled:
        return "-"
    m = re.search(r" in (\d+) parts on", plan.compiled)
    way = f"{m.group(1)} parts" if m else "whole"
    times = re.findall(r"(whole|parts|tier 0) ([\d.]+) us", plan.compiled.split("measured", 1)[-1])
    if times:
        way += " (" + " / ".join(f"{name} {float(us) / 1e3:.3g}" for name, us in times) + ")"
    return way


def case_key(case):
    return f"{case.workload}/{case.name}"


# Variants timed in a process of their own (child_variant): eager with one
# intra-op thread (setting the thread count to 1 and back slowed every later
# run of a process, eager and mgpu alike, by 25-50% on inception), and
# jit.fork (its inter-op threads, each with an OpenMP team of its own, slowed
# every later run of a process: eager with two threads 2.4x, mgpu 1.4x, on
# 2 branches 64).
# mgpu's default configuration too: a user's program runs it in a process
# of its own, not in one where inductor compiled, torch.compile'd functions
# and tier 1 with other settings ran before it (there, the trial of 2
# branches 64 measured the lazy way at 131 us and chose the way at the call;
# alone it measured 25 us and kept the lazy way).
CHILD_VARIANTS = ("eager_1t", "jit_fork", "mgpu")


def in_child(variant, case, quick):
    """Times one variant of a case in a child process (see CHILD_VARIANTS):
    its results (`variant`: the timing, and what else the child reports)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, case_key(case)] + (["--quick"] if quick else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{variant} run of {case_key(case)} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def time_default(case, mg_in, cpu_in):
    """The default configuration's timed runs, after its compiles and trials
    settled, round-robin with eager (default threads) in the same process
    (`eager_beside`: the speed-up's eager, measured beside it): its timing,
    the way it ran, its plans' predicted / measured."""
    settle_default(case, mg_in)
    DEFAULT_WAY.update(graphs=0, tier1=0, at_call=0, runs=0)
    PLAN_RATIOS.clear()
    res = measure_interleaved({"eager_beside": (lambda: case.fn(*cpu_in), nothing, nothing),
                               "mgpu": (lambda: mgpu_sync(case.fn(*mg_in)), default_enter, default_leave)}, case.reps)
    return {"mgpu": res["mgpu"], "eager_beside": res["eager_beside"], "default_way": default_way(),
            "plan_ratio": statistics.median(PLAN_RATIOS) if PLAN_RATIOS else float("nan")}


def child_variant(variant, key, quick):
    if variant not in CHILD_VARIANTS:
        print(f"no child variant {variant}", file=sys.stderr)
        return 2
    if variant == "eager_1t":
        torch.set_num_threads(1)
    if variant == "mgpu":
        torch_mgpu._C._cost_model()  # calibrated first, as in main()
    for mod in MODULES:
        for case in mod.cases(quick):
            if case_key(case) == key:
                if variant == "mgpu":
                    mg_in = case.make("mgpu")
                    torch_mgpu.synchronize()
                    res = time_default(case, mg_in, case.make("cpu"))
                else:
                    cpu_in = case.make("cpu")
                    fn = case.fn if variant == "eager_1t" else case.fork
                    res = measure_interleaved({variant: (lambda: fn(*cpu_in), nothing, nothing)}, case.reps)
                print(json.dumps(res), flush=True)
                # No teardown: jit.fork's inter-op threads may still run then
                # ("terminate called without an active exception").
                os._exit(0)
    print(f"no case {key}", file=sys.stderr)
    return 2


def run_case(case, quick):
    res = {}
    cpu_in = case.make("cpu")
    mg_in = case.make("mgpu")
    torch_mgpu.synchronize()
    capture_only = case.extra.get("capture_only", False)

    # Eager with one thread and jit.fork run in processes of their own
    # (CHILD_VARIANTS).
    res.update(in_child("eager_1t", case, quick))
    if case.fork is not None:
        res.update(in_child("jit_fork", case, quick))
    variants = {"eager": (lambda: case.fn(*cpu_in), nothing, nothing)}
    compiled_fns = {}
    if not quick and case.compile_ok:
        # Cases share functions (several shapes, two backends): recompiles
        # past dynamo's default limit would silently run eager.
        torch._dynamo.config.recompile_limit = 64
        # torch.compile with inductor, and with the mgpu backend (inductor's
        # kernels in partitions planned over the lanes), on the CPU inputs.
        # Graphs the mgpu backend compiles from here on are this case's.
        first_graph = max((g["id"] for g in torch_mgpu.compile_choices()), default=-1)
        for key, backend in (("compile", "inductor"), ("mgpu_compiled", "mgpu")):
            try:
                fn = torch.compile(case.fn, backend=backend)
                # Inputs of its own: a module's gradients left by another
                # variant (eager's strides, inductor's) would fail this one's
                # guards and switch it between recompiled graphs.
                args = copy.deepcopy(cpu_in)
                t = time.perf_counter()
                fn(*args)  # compiles here, so that a failure is reported, not hidden
                res[key + "_seconds"] = time.perf_counter() - t
                if key == "mgpu_compiled":
                    # A split graph's first calls time its two ways (as
                    # autotuning would): done here, before the timed runs.
                    # (A graph dynamo does not call again, such as one
                    # compiled for gradients still None, stays undecided.)
                    from torch_mgpu import compile as mgpu_compile
                    for _ in range(2 * (mgpu_compile.TRIALS + 1)):
                        if all(g["choice"] for g in torch_mgpu.compile_choices() if g["id"] > first_graph):
                            break
                        fn(*args)
                compiled_fns[key] = (fn, args)
                variants[key] = (lambda fn=fn, args=args: fn(*args), nothing, nothing)
            except Exception as e:  # report, do not hide
                res[key + "_error"] = f"{type(e).__name__}: {str(e)[:80]}"
    saved_async, saved_hits = torch_mgpu.async_ops(), torch_mgpu._C._tier_compile_hits()
    saved_at_call = torch_mgpu._C._at_call()
    if capture_only:
        # Time the recording only: the sync runs untimed after each run (and
        # no flight runs during it: background execution is off; nor a
        # compile: tier 1 is off).
        recorded = []
        torch_mgpu.set_async_ops(0)
        torch_mgpu.configure(compile=0, at_call="off")

        def sync_recorded():
            torch_mgpu.synchronize()
            recorded.clear()
        variants["mgpu"] = (lambda: recorded.append(case.fn(*mg_in)), nothing, sync_recorded)
    else:
        # The default configuration alone, in a process of its own.
        res.update(in_child("mgpu", case, quick))
        if not quick:
            res.update(prepare_tier1(case, mg_in))
            if "tier1" in res:
                variants["mgpu_tier1"] = (lambda: mgpu_sync(case.fn(*mg_in)), tier1_enter, tier1_leave)
    PLAN_RATIOS.clear()
    try:
        res.update(measure_interleaved(variants, case.reps))
    finally:
        torch_mgpu.set_async_ops(saved_async)
        torch_mgpu.configure(compile=saved_hits, at_call=saved_at_call)
    if capture_only:
        res["plan_ratio"] = float("nan")
        res["mgpu"]["peak_mib"] = 0.0
    else:
        # The simulator plans what is pending: capture the whole workload
        # without background execution. The sync that follows runs that
        # very graph: its measured makespan is what the simulation predicts
        # (twice: the second run's plan is the cached one, as in a loop).
        saved_async = torch_mgpu.async_ops()
        torch_mgpu.set_async_ops(0)
        torch_mgpu.configure(at_call="off")  # the workload recorded, to be simulated
        for _ in range(2):
            before = torch_mgpu.stats()
            out = case.fn(*mg_in)
            after = torch_mgpu.stats()
            # Syncs during capture (item(), data-dependent ops) ran part of the work.
            fallbacks = (after["eager_fallbacks"] - before["eager_fallbacks"]) + (after["syncs"] - before["syncs"])
            sim = torch_mgpu.simulate(devices=len(set(l.split("/")[0] for l in torch_mgpu.lanes())),
                                      lanes_per_device=max(1, len(torch_mgpu.lanes())))
            torch_mgpu.synchronize()
            del out
        torch_mgpu.set_async_ops(saved_async)
        torch_mgpu.configure(at_call=saved_at_call)
        if fallbacks == 0:
            res["simulated"] = {"median": sim.makespan, "min": sim.makespan, "max": sim.makespan,
                                "peak_mib": float("nan")}
            ran = torch_mgpu.last_plan()
            if ran is not None and ran.measured_makespan > 0:
                res["sim_ratio"] = sim.makespan / ran.measured_makespan
        else:  # part of the work ran eagerly during capture: the pending graph is not the workload
            res["simulated_error"] = f"n/a ({fallbacks} syncs or eager ops during capture)"
        plan = torch_mgpu.last_plan()
        res["plan"] = {"lanes_used": plan.lanes_used if plan else 1, "policy": plan.policy if plan else "",
                       "predicted": plan.predicted_makespan if plan else 0,
                       "measured": plan.measured_makespan if plan else 0}
    # Correctness guard: mgpu equals eager on this case. A training step
    # changes its inputs (weights, optimizer state): each variant trained
    # its own copy for a different number of steps, so the guard takes two
    # steps from fresh copies and compares the second (its loss reads the
    # first step's update: the optimizer's work is checked too).
    if case.extra.get("stateful"):
        cpu_in, mg_in = case.make("cpu"), case.make("mgpu")
        if "mgpu_compiled" in compiled_fns:
            fn, args = compiled_fns["mgpu_compiled"][0], copy.deepcopy(cpu_in)
            fn(*args)
            compiled_fns["mgpu_compiled"] = (fn, args)
        case.fn(*cpu_in)
        case.fn(*mg_in)
    ref = case.fn(*cpu_in)
    if "mgpu_compiled" in compiled_fns:
        fn, args = compiled_fns["mgpu_compiled"]
        check(ref, fn(*args))
        # Each graph's partitions and the way its first calls chose; for
        # partitions on the lanes, the last plan's prediction over its
        # measurement (the whole graph, or one partition, runs with no plan).
        graphs = [g for g in torch_mgpu.compile_choices() if g["id"] > first_graph]
        res["compiled_graphs"] = graphs
        plan = torch_mgpu.last_plan()
        parts = [e for e in plan.timeline() if e["op"].startswith("partition#")] if plan else []
        if parts and len(parts) == len(plan) and any(g["choice"] == "partitions" for g in graphs):
            res["compiled_plan_ratio"] = plan.predicted_makespan / plan.measured_makespan
    got = tree_map(lambda t: t.cpu() if t.device.type == "mgpu" else t, case.fn(*mg_in))
    check(ref, got)
    # The guard's and the simulation's runs (default settings) may have made
    # graphs hot: their compiles end here, not during the next case's runs.
    torch_mgpu.wait_for_compiles(600)
    return res


def best_eager(r):
    """The better of eager with default threads and eager with one thread
    (seconds): what a user could pick instead of mgpu. Eager with default
    threads as timed round-robin with mgpu's default in its process
    (`eager_beside`) where it was: mgpu's speed-up then compares runs of one
    process, interleaved (the machine's speed moves between processes: the
    parent's eager and the child's differed by up to 1.4x in one run)."""
    eager = r["eager_beside"]["median"] if "eager_beside" in r else r["eager"]["median"]
    return min(eager, r["eager_1t"]["median"]) if "eager_1t" in r else eager


def graphs_cell(graphs):
    """'5: whole (78.1 / 61.0)': partitions, the way kept, both medians in ms."""
    if not graphs:
        return "-"
    out = []
    for g in graphs:
        if g["partitions"] < 2:
            out.append("1")
            continue
        times = " / ".join("-" if g[k] is None else f"{g[k] * 1e3:.3g}" for k in ("partitions_s", "whole_s"))
        out.append(f"{g['partitions']}: {g['choice'] or 'measuring'} ({times})")
    return "; ".join(out)


def check(ref, got):
    if isinstance(ref, torch.Tensor):
        if ref.dtype in (torch.int64, torch.int32):
            return  # indices from topk may tie-break differently within tolerance
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    elif isinstance(ref, (list, tuple)):
        for r, g in zip(ref, got):
            check(r, g)


def fmt_ms(r):
    return f"{r['median'] * 1e3:.3f} ({r['min'] * 1e3:.2f}..{r['max'] * 1e3:.2f})"


def kept_sections(path, md):
    """The `## ` sections of the file at `path` that this run did not write
    (measurements of other scripts, kept by hand, each with its date), to
    follow the new tables: a run replaces only what it measured."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        old = f.read()
    written = {line for line in md.splitlines() if line.startswith("## ")}
    out, keep = [], False
    for line in old.splitlines():
        if line.startswith("## "):
            keep = line not in written
        if keep:
            out.append(line)
    return ("\n\n" + "\n".join(out).rstrip() + "\n") if out else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: VARIANT CASE, alone
    a = ap.parse_args()
    if a.child:
        return child_variant(a.child[0], a.child[1], a.quick)
    only = set(a.only.split(",")) if a.only else None
    # mgpu calibrates its cost model at first use: here, before inductor's
    # compile workers start and load the machine.
    torch_mgpu._C._cost_model()
    out_dir = os.path.join(HERE, "out") if a.quick else HERE
    os.makedirs(out_dir, exist_ok=True)

    rows = []
    t0 = time.time()
    for mod in MODULES:
        for case in mod.cases(a.quick):
            if only and case.workload not in only:
                continue
            r = run_case(case, a.quick)
            rows.append((case, r))
            e = r["eager"]["median"]
            parts = [f"{case.workload:14s} {case.name:30s}"]
            for k in ["eager", "eager_1t", "compile", "jit_fork", "mgpu", "mgpu_compiled", "simulated"]:
                if k in r:
                    parts.append(f"{k} {r[k]['median'] * 1e3:8.3f}ms ({e / r[k]['median']:.2f}x)")
            print("  ".join(parts), flush=True)

    lanes = torch_mgpu.lanes()
    header = [
        "# Benchmark results",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        f"- torch {torch.__version__}, {torch.get_num_threads()} intra-op threads",
        f"- mgpu lanes: {', '.join(lanes)}; policy {torch_mgpu.policy()}",
        f"- mode: {'quick' if a.quick else 'full'}; {time.time() - t0:.0f} s",
        "",
        "Times in ms: median (min..max) of the repetitions after 5 warm-up runs; the variants of a case run",
        "round-robin (eager, torch.compile, mgpu tier 1, then again; eager with 1 thread, jit.fork and mgpu's default each in a process of its own,",
        "mgpu's default round-robin with eager there (`eager beside mgpu`):",
        "the first two slowed later runs of a process, and a user's program runs mgpu in a process of its own, not after inductor's compiles),",
        "so that changes in the machine's speed hit them alike, each run after 3 ms idle (threads the run before",
        "left spinning, an OpenMP team's or mgpu's lanes, would take the core the next one runs on). Speed-up is over the better of eager",
        "with default threads, timed beside mgpu, and eager with one thread (what a user could pick instead; higher is better).",
        "Peak MiB: growth of peak RSS during the timed runs.",
        "`simulated`: the simulator's predicted execution time for the same lanes (capture excluded);",
        "`simulated / measured`: that prediction over the measured makespan of the sync that then runs the",
        "simulated graph (the whole workload as one graph, its plan cached: the second of two runs).",
        "",
        "`predicted / measured`: median over the timed runs of the last executed plan's predicted makespan over",
        "its measured one (last_plan(); with background execution, the plan of the graph left at the sync).",
        "`mgpu` is the default configuration (tier 1 on, background flights, repeated traces tried at the call),",
        "timed after its compiles and trials settled; `default ran`: `at the call a/b`, of its b timed and warm-up runs,",
        "the a that ran their ops at the call (`one thread`: with one intra-op thread), and `tier 1 a/b`, of the graphs",
        "its lazy runs ran (syncs and flights), those that ran compiled code.",
        "",
        "| workload | case | eager | eager 1 thread | torch.compile | jit.fork | mgpu | eager beside mgpu | default ran | mgpu tier 1 | simulated | simulated / measured | mgpu speed-up | lanes used | predicted / measured | peak MiB eager / mgpu |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    compiled_lines = [
        "",
        "## torch.compile: inductor against the mgpu backend",
        "",
        "`mgpu compiled`: `torch.compile(fn, backend=\"mgpu\")` on the CPU inputs: inductor's kernels, the graph split",
        "into partitions along its branches, the partitions planned over the lanes (one partition: called directly).",
        "A split graph is also compiled whole; its first calls (before the timed runs) time both ways and keep the faster:",
        "`partitions` shows, per graph (forward; backward), the partition count and for a split graph the way kept",
        "with the medians measured (partitions on the lanes / the whole graph, ms).",
        "Measured in the same round-robin as the table above. Compile seconds: the first call (the",
        "inductor cache, shared by both, may be warm from earlier runs; a split graph compiles twice).",
        "`predicted / measured`: the last plan of the compiled call, where it kept its partitions.",
        "A one-partition graph runs inductor's own code through a thin call: where the table shows it faster",
        "than inductor, the gap is the measurement's (timed alone, both run the 1000-op chain in about 45 us).",
        "",
        "| workload | case | torch.compile (inductor) | mgpu compiled | mgpu compiled / inductor speed | partitions | predicted / measured | compile s inductor / mgpu |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines = list(header)
    for case, r in rows:
        def cell(k):
            if k in r:
                return fmt_ms(r[k])
            return r.get(k + "_error", "-")
        if case.extra.get("ops"):
            n = case.extra["ops"]
            cap = (f"capture {r['mgpu']['median'] * 1e6 / n:.2f} us/op vs eager {r['eager']['median'] * 1e6 / n:.2f} us/op")
            lines.append(f"| {case.workload} | {case.name} | {cell('eager')} | {cell('eager_1t')} | - | - | {cell('mgpu')} | - | - | - | - | - | {cap} | - | - | - |")
            continue
        sp = best_eager(r) / r["mgpu"]["median"]
        pm = r["plan"]
        ratio = f"{r['plan_ratio']:.2f}" if r["plan_ratio"] == r["plan_ratio"] else "-"
        sim_ratio = f"{r['sim_ratio']:.2f}" if "sim_ratio" in r else "-"
        lines.append(
            f"| {case.workload} | {case.name} | {cell('eager')} | {cell('eager_1t')} | {cell('compile')} | "
            f"{cell('jit_fork')} | {cell('mgpu')} | {cell('eager_beside')} | {r.get('default_way', '-')} | {cell('mgpu_tier1')} | {cell('simulated')} | {sim_ratio} | {sp:.2f}x | {pm['lanes_used']} | {ratio} | "
            f"{r['eager']['peak_mib']:.1f} / {r['mgpu']['peak_mib']:.1f} |")
    for case, r in rows:
        if "compile" not in r or "mgpu_compiled" not in r:
            if "compile_error" in r or "mgpu_compiled_error" in r:
                compiled_lines.append(f"| {case.workload} | {case.name} | {r.get('compile_error', '-')} | "
                                      f"{r.get('mgpu_compiled_error', '-')} | - | - | - | - |")
            continue
        ratio = r.get("compiled_plan_ratio")
        compiled_lines.append(
            f"| {case.workload} | {case.name} | {fmt_ms(r['compile'])} | {fmt_ms(r['mgpu_compiled'])} | "
            f"{r['compile']['median'] / r['mgpu_compiled']['median']:.2f}x | {graphs_cell(r.get('compiled_graphs'))} | "
            f"{f'{ratio:.2f}' if ratio else '-'} | {r['compile_seconds']:.1f} / {r['mgpu_compiled_seconds']:.1f} |")
    if len(compiled_lines) > 11:
        lines += compiled_lines
    tier1_lines = [
        "",
        "## Tier 1: the lazy path's hot graphs compiled in the background",
        "",
        f"`mgpu tier 1` (table above): `configure(compile={TIER1_HITS})` with background execution off (tier 1 runs",
        "foreground syncs: the workload is one graph per sync); before the timed runs, the workload ran until its",
        "graph compiled and its trial (one cold and three timed compiled runs, in turns with three node-by-node runs) decided.",
        "`started at run`: the run that first ran compiled code; `kept`: whether the trial kept it (else the",
        "timed runs are tier 0 with background execution off); compile seconds on the background thread.",
        "`way`: a graph with branches worth the lanes is compiled whole and in parts run side by side on the",
        "lanes; the trial times both and tier 0 (ms, medians) and keeps the fastest.",
        "",
        "| workload | case | mgpu | mgpu tier 1 | tier 1 / best eager speed | tier 1 / inductor speed | started at run | kept | way | compile s | why not kept |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, r in rows:
        t = r.get("tier1")
        if t is None or "mgpu_tier1" not in r:
            continue
        tier1 = r["mgpu_tier1"]["median"]
        vs_compile = f"{r['compile']['median'] / tier1:.2f}x" if "compile" in r else "-"
        why = ("" if t["kept"] else "no graph compiled (none qualified)" if not t["compiled"]
               else (t["why"] or "").replace("|", "/")[:80])
        tier1_lines.append(
            f"| {case.workload} | {case.name} | {fmt_ms(r['mgpu'])} | {fmt_ms(r['mgpu_tier1'])} | "
            f"{best_eager(r) / tier1:.2f}x | {vs_compile} | {t['started'] or '-'} | {'yes' if t['kept'] else 'no'} | "
            f"{t.get('way', '-')} | {t['compile_s']:.1f} | {why} |")
    if len(tier1_lines) > 11:
        lines += tier1_lines
    sim_rows, planning = bench_simulator.report(a.quick)
    sim_md = bench_simulator.markdown(sim_rows, planning)
    sim_md += "\n" + bench_simulator.gpu_markdown(
        bench_simulator.gpu_report([c for mod in MODULES for c in mod.cases(a.quick)]))
    print(sim_md)
    md = "\n".join(lines) + "\n\n" + sim_md
    path = os.path.join(out_dir, "RESULTS.md" if not a.quick else "results_quick.md")
    md += kept_sections(path, md)
    with open(path, "w") as f:
        f.write(md)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        labels = [f"{c.workload}\n{c.name}" for c, r in rows if "plan" in r]
        keys = ["eager_1t", "compile", "jit_fork", "mgpu", "simulated"]
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(labels)), 5))
        width = 0.16
        for j, k in enumerate(keys):
            vals = [(r["eager"]["median"] / r[k]["median"]) if k in r else float("nan") for c, r in rows if "plan" in r]
            ax.bar([i + (j - 2) * width for i in range(len(labels))], vals, width, label=k)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("speed-up over eager (default threads), log scale")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "speedup.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {out_dir}/{'RESULTS.md' if not a.quick else 'results_quick.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
