"""Python threads against the engine: a monitoring thread beside a capturing
one, storages dying on other threads, and a random stress of every public
function. Each runs in a child process under a watchdog (faulthandler), so a
deadlock fails the test with every thread's stack instead of hanging."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run(scenario, seconds, threads, **env):
    out = subprocess.run([sys.executable, os.path.join(HERE, "stress_threads.py"), scenario, str(seconds), str(threads)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, **env))
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-6000:]}"
    assert out.stdout.startswith("ok"), out.stdout
    return out.stdout


def test_monitoring_thread_beside_capture_of_new_signatures():
    # Capture runs Python Meta kernels under the engine lock while the
    # other thread holds the GIL and asks for lanes(), stats(), last_plan()...
    run("monitor", 3, 2)


def test_storages_dying_on_other_threads():
    run("deleters", 3, 4)


@pytest.mark.parametrize("async_ops", ["0", "16"])
def test_random_stress_of_every_public_function(async_ops):
    run("stress", 5, 4, TORCH_MGPU_ASYNC_OPS=async_ops)


_TEAMS = r"""
import collections, os, torch, torch_mgpu
torch.set_num_threads(2)
torch_mgpu.configure(compile=2)
torch_mgpu.set_async_ops(3)
g = torch.Generator().manual_seed(5)
w = torch.randn(384, 384, generator=g) / 20
x = torch.randn(384, 384, generator=g)
mw, mx = w.to("mgpu"), x.to("mgpu")
for i in range(8):
    y, e = mx, x
    for k in range(6):  # a chain: one lane, the caller's two threads, in flights
        y, e = (y @ mw).tanh(), (e @ w).tanh()
    assert torch.allclose(y.cpu(), e, atol=1e-4)
    torch_mgpu.wait_for_compiles(300)
s = torch_mgpu.stats()
assert s["background_flushes"] > 0 and s["tier1_compiled"] > 0, s
def names():
    return collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
import time
end = time.time() + 10  # the worker lets go of its team once idle (after its spin)
while names().get("mgpu-flights", 0) != 1 and time.time() < end:
    time.sleep(0.05)
print("ok", dict(names()))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="an OpenMP team needs two cores")
def test_mgpu_threads_keep_no_openmp_team_after_their_work():
    """A thread's OpenMP team workers are its own threads and inherit its
    name: after flights ran a chain with two intra-op threads and tier 1
    compiled it, the idle background worker is alone (libgomp counts every team's threads, and while they outnumber the
    cores every multithreaded kernel of the process pays for waking its
    team)."""
    out = subprocess.run([sys.executable, "-c", _TEAMS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith("ok"), out.stdout
    names = eval(out.stdout.split(" ", 1)[1])
    assert names.get("mgpu-flights") == 1, names
    assert names.get("mgpu-lane", 0) <= 1, names  # the lane workers of 2 cores: one
