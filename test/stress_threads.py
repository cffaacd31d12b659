"""Threads against the engine, under a watchdog: run as a script by
test_threads.py (a hang becomes a traceback and a failure, not a stuck run).

    python test/stress_threads.py SCENARIO SECONDS THREADS

Scenarios:
  monitor  one thread records ops with a new signature each call (Meta
           kernels written in Python, so capture takes the GIL under the
           engine's lock) while another calls the read-only API in a loop
  deleters threads create and drop mgpu tensors (their storages die with the
           GIL held) while others capture new signatures and sync
  stress   every thread picks actions at random: capture new signatures and
           compare with eager, sync, call every public torch_mgpu and
           torch.mgpu function, configure lanes, simulate
Prints "ok <iterations>" and exits 0, or prints what went wrong and exits 1.
"""
import faulthandler
import random
import sys
import threading
import time
import traceback

import torch

import torch_mgpu

WATCHDOG_S = 120


def check_equal(got, want, what):
    if not torch.allclose(got.cpu(), want, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{what}: mgpu differs from eager by {(got.cpu() - want).abs().max().item()}")


def capture_new_signature(rng, n):
    # A new shape each call: a meta-cache miss, so a Meta kernel runs (tanh's
    # and mm's are Python in torch 2.13).
    x = torch.randn(n % 97 + 1, n % 13 + 2, generator=rng)
    w = torch.randn(x.shape[1], 3, generator=rng)
    xm, wm = x.to("mgpu"), w.to("mgpu")
    y = torch.tanh(xm @ wm).relu() + xm.sum()
    z = xm.clone()
    z.add_(1.5).mul_(0.5)
    check_equal(y, torch.tanh(x @ w).relu() + x.sum(), "capture")
    check_equal(z, (x + 1.5) * 0.5, "in-place")
    # expand of a 1-element tensor to a growing size (the reported hang)
    e = torch.tanh(torch.full((1,), 0.25, device="mgpu").expand(n % 4096 + 1))
    check_equal(e, torch.tanh(torch.full((n % 4096 + 1,), 0.25)), "expand")


def read_api():
    torch_mgpu.lanes()
    torch_mgpu.policy()
    torch_mgpu.stats()
    torch_mgpu.pending_ops()
    torch_mgpu.max_pending_ops()
    torch_mgpu.async_ops()
    p = torch_mgpu.last_plan()
    if p is not None:
        str(p)
        p.timeline()
        p.to_dot()
    torch.mgpu.device_count()
    torch.mgpu.is_available()
    torch.mgpu.current_device()
    torch.mgpu.is_initialized()
    torch.mgpu.initial_seed()
    torch.mgpu.get_rng_state()


def write_api(rng):
    k = rng.randrange(7)
    if k == 0:
        torch_mgpu.configure(devices=rng.choice([["cpu"], ["cpu", "cpu"]]), lanes_per_device=rng.choice([1, 2]),
                             policy=rng.choice(["auto", "heft", "serial"]))
    elif k == 1:
        torch_mgpu.set_async_ops(rng.choice([0, 8, 64, 256]))
    elif k == 2:
        torch_mgpu.set_max_pending_ops(rng.choice([50, 1000, 100000]))
    elif k == 3:
        s = torch_mgpu.simulate(devices=rng.choice([1, 2, 4]), lanes_per_device=rng.choice([1, 2]))
        assert s.makespan >= s.lower_bound * 0.999, (s.makespan, s.lower_bound)
    elif k == 4:
        torch_mgpu.empty_cache()
    elif k == 5:
        torch.mgpu.synchronize()
        torch.mgpu.set_device(0)
        torch.mgpu.manual_seed(rng.randrange(1 << 20))
        torch.mgpu.set_rng_state(torch.mgpu.get_rng_state())
    else:
        torch_mgpu.synchronize()


def run_threads(targets, seconds):
    stop = threading.Event()
    errors, counts = [], [0] * len(targets)

    def wrap(k, fn):
        def body():
            rng = random.Random(k)
            try:
                while not stop.is_set():
                    fn(rng, counts[k])
                    counts[k] += 1
            except BaseException:
                errors.append(f"thread {k}:\n{traceback.format_exc()}")
                stop.set()
        return body

    threads = [threading.Thread(target=wrap(k, fn), daemon=True) for k, fn in enumerate(targets)]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    torch_mgpu.synchronize()
    return errors, counts


def main():
    scenario, seconds, nthreads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hang: every thread's stack, then exit 1

    def capturing(rng, i):
        capture_new_signature(torch.Generator().manual_seed(rng.randrange(1 << 30)), i * 7 + rng.randrange(7))

    def monitoring(rng, i):
        read_api()

    def dropping(rng, i):
        xs = [torch.randn(rng.randrange(1, 64), device="mgpu") for _ in range(16)]
        ys = [x * 2 for x in xs]
        del xs, ys  # storages die here, GIL held

    def anything(rng, i):
        k = rng.randrange(10)
        if k < 5:
            capturing(rng, i)
        elif k < 7:
            read_api()
        elif k < 9:
            write_api(rng)
        else:
            dropping(rng, i)

    if scenario == "monitor":
        targets = [capturing] + [monitoring] * max(1, nthreads - 1)
    elif scenario == "deleters":
        targets = [capturing, dropping] * max(1, nthreads // 2)
    elif scenario == "stress":
        targets = [anything] * nthreads
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    errors, counts = run_threads(targets, seconds)
    if errors:
        print("\n".join(errors))
        sys.exit(1)
    if min(counts) == 0:
        print(f"a thread made no progress: {counts}")
        sys.exit(1)
    print("ok", sum(counts), counts)


if __name__ == "__main__":
    main()
