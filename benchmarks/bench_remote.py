"""Lanes on other ranks: two processes on this machine over loopback Gloo,
one intra-op thread each, against one process.

    python benchmarks/bench_remote.py [--reps N]

Starts a worker (`python -m torch_mgpu.worker`, rank 1) and measures, in one
run and round-robin: eager with all threads and with one thread (one rank),
mgpu with two lanes in one process (two threads), mgpu on this process's lane and the worker's
(`["cpu", "rank1:cpu"]`), and the per-sync cost of a cached plan whose one
node runs on the worker. Prints a table and the simulator's prediction for
the two-rank plans against their measured times, and its plans for 2 and 3
hosts with cores of their own (which one machine cannot show).
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                      OMP_NUM_THREADS="1", TORCH_MGPU_WORKER_THREADS="1")
    worker = subprocess.Popen([sys.executable, "-m", "torch_mgpu.worker"], env=dict(os.environ, RANK="1"))
    os.environ["RANK"] = "0"
    import torch
    import torch.distributed as dist

    import torch_mgpu
    import bench_branches
    import bench_kernels
    from common import tree_map

    dist.init_process_group("gloo")
    try:
        run(args, torch, torch_mgpu, bench_branches, bench_kernels, tree_map)
    finally:
        torch_mgpu.release_workers()
        worker.wait(timeout=60)


def run(args, torch, torch_mgpu, bench_branches, bench_kernels, tree_map):
    cases = [c for c in bench_branches.cases(False) if c.name == "16 branches 256"]
    cases += [c for c in bench_kernels.cases(False) if c.name.startswith("kNN")]
    configs = {
        "eager": "all",
        "eager 1 thread": None,
        "mgpu 2 lanes, 1 process": (["cpu"], 2, 2),
        "mgpu 2 ranks": (["cpu", "rank1:cpu"], 1, 1),
    }
    rows = []
    for case in cases:
        cpu_inputs = case.make("cpu")
        mgpu_inputs = tree_map(lambda t: t.to("mgpu"), cpu_inputs)
        times = {k: [] for k in configs}
        predicted, measured, ranks = [], [], []

        def once(name, timed=True):
            cfg = configs[name]
            if cfg is None or cfg == "all":
                torch.set_num_threads(1 if cfg is None else os.cpu_count())
                t0 = time.perf_counter()
                case.fn(*cpu_inputs)
                return time.perf_counter() - t0
            devices, lanes, threads = cfg
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            out = case.fn(*mgpu_inputs)
            torch_mgpu.synchronize()
            dt = time.perf_counter() - t0
            del out
            if name == "mgpu 2 ranks" and timed:
                plan = torch_mgpu.last_plan()
                predicted.append(plan.predicted_makespan)
                measured.append(plan.measured_makespan)
                ranks.append(plan.lanes_used)
            return dt

        # Round-robin over the configurations; each turn configures its
        # lanes (configure() drops the cached plans), runs until its plan
        # has learned what it measures (refined after 4 runs; a plan with
        # lanes on other ranks is then measured against one lane, 3 runs
        # each), then is timed.
        for _ in range(args.reps):
            for name, cfg in configs.items():
                warm = 2
                if isinstance(cfg, tuple):
                    torch_mgpu.configure(devices=cfg[0], lanes_per_device=cfg[1], policy="auto")
                    warm = 12
                for _ in range(warm):
                    once(name, timed=False)
                times[name].append(min(once(name) for _ in range(2)))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((case.name, med, statistics.median(predicted), statistics.median(measured),
                     sum(r > 1 for r in ranks) / len(ranks)))

    print(f"{'case':28s} " + " ".join(f"{k:>24s}" for k in configs) + "   2 ranks vs eager 1t, vs best eager")
    for name, med, pred, meas, _ in rows:
        best = min(med["eager"], med["eager 1 thread"])
        print(f"{name:28s} " + " ".join(f"{med[k] * 1e3:21.2f} ms" for k in configs) +
              f"   {med['eager 1 thread'] / med['mgpu 2 ranks']:.2f}x, {best / med['mgpu 2 ranks']:.2f}x")
    print()
    for name, med, pred, meas, spread in rows:
        print(f"{name}: simulator predicted {pred * 1e3:.2f} ms for the plan that ran, measured {meas * 1e3:.2f} ms "
              f"(ratio {meas / pred:.2f}); it used both ranks in {spread:.0%} of the timed runs")

    # Hosts with cores of their own, which this machine cannot show: the
    # simulator's plan for 2 and 3 hosts (one lane each, one thread, the
    # cost model's network: 100 us, 1 GB/s) against one lane.
    print()
    torch.set_num_threads(1)
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=1, policy="auto")
    saved_async = torch_mgpu.async_ops()
    torch_mgpu.set_async_ops(0)
    for case in cases:
        mgpu_inputs = tree_map(lambda t: t.to("mgpu"), case.make("cpu"))
        out = case.fn(*mgpu_inputs)
        one = torch_mgpu.simulate(devices=1, lanes_per_device=1, policy="auto").makespan
        hosts = {h: torch_mgpu.simulate(devices=1, lanes_per_device=1, policy="auto", hosts=h).makespan for h in (2, 3)}
        torch_mgpu.synchronize()
        del out
        print(f"{case.name}: simulated on separate hosts, one lane {one * 1e3:.2f} ms, 2 hosts {hosts[2] * 1e3:.2f} ms "
              f"({one / hosts[2]:.2f}x), 3 hosts {hosts[3] * 1e3:.2f} ms ({one / hosts[3]:.2f}x)")
    torch_mgpu.set_async_ops(saved_async)

    # Per-sync cost of a cached plan with one node on the worker, beside
    # the same sync on this process's lane.
    torch.set_num_threads(1)
    x = torch.randn(16).to("mgpu")
    per = {}
    for devices in (["cpu"], ["rank1:cpu"]):
        torch_mgpu.configure(devices=devices, lanes_per_device=1)
        for _ in range(50):
            (x + 1).cpu()
        t0 = time.perf_counter()
        n = 500
        for _ in range(n):
            (x + 1).cpu()
        per[devices[0]] = (time.perf_counter() - t0) / n
    print(f"\nsync of a cached 1-node plan: this process {per['cpu'] * 1e6:.0f} us, on rank 1 "
          f"{per['rank1:cpu'] * 1e6:.0f} us: {1e6 * (per['rank1:cpu'] - per['cpu']):.0f} us for the remote lane")


if __name__ == "__main__":
    main()
