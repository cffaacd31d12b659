"""Background execution: once `async_ops` ops are pending they run on a
background worker while capture goes on. Results, errors and in-place
semantics must be those of one sync at the end."""
import gc
import os
import random
import resource
import signal
import threading
import time

import pytest
import torch

import torch_mgpu

from conftest import restore_lanes
from test_errors import capture_in_threads
from test_parallel import check_random_dag


@pytest.fixture
def async_ops():
    before = torch_mgpu.async_ops()
    lanes_before = (torch_mgpu.lanes(), torch_mgpu.policy())

    def set_(n):
        torch_mgpu.set_async_ops(n)

    yield set_
    torch_mgpu.synchronize()
    torch_mgpu.set_async_ops(before)
    restore_lanes(*lanes_before)


def counters():
    s = torch_mgpu.stats()
    return s["background_flushes"], s["syncs"]


def test_long_chain_runs_in_the_background(async_ops):
    async_ops(32)
    x_cpu = torch.randn(64)
    x = x_cpu.to("mgpu")
    flushes0, _ = counters()
    for _ in range(100):
        x = x * 1.0001
        x_cpu = x_cpu * 1.0001
        x = x + 0.0001
        x_cpu = x_cpu + 0.0001
    flushes1, _ = counters()
    assert flushes1 - flushes0 >= 4  # 200 ops in flights of 32
    assert torch_mgpu.pending_ops() < 200
    assert torch.equal(x.cpu(), x_cpu)


def test_off_means_one_sync(async_ops):
    async_ops(0)
    x = torch.randn(8).to("mgpu")
    flushes0, syncs0 = counters()
    for _ in range(300):
        x = x + 1
    assert torch_mgpu.pending_ops() == 300
    x.cpu()
    flushes1, syncs1 = counters()
    assert (flushes1 - flushes0, syncs1 - syncs0) == (0, 1)
    with pytest.raises(RuntimeError, match="async_ops must be >= 0"):
        torch_mgpu.set_async_ops(-1)


def test_inplace_and_views_across_flights(async_ops):
    async_ops(8)
    base_cpu = torch.randn(6, 5)
    base = base_cpu.to("mgpu")
    row, col = base[2], base[:, 1]
    row_cpu, col_cpu = base_cpu[2], base_cpu[:, 1]
    for k in range(40):
        for t in (base, base_cpu):
            t.mul_(0.99).add_(k * 0.01)
        row.add_(1.0)
        row_cpu.add_(1.0)
        col.sub_(0.5)
        col_cpu.sub_(0.5)
        keep, keep_cpu = base.t().sum(0), base_cpu.t().sum(0)
    assert torch.equal(base.cpu(), base_cpu)
    assert torch.equal(row.cpu(), row_cpu)
    assert torch.equal(keep.cpu(), keep_cpu)


def test_error_in_the_background_surfaces_at_the_next_sync(async_ops):
    async_ops(16)
    x_cpu = torch.randn(5, 3)
    x = x_cpu.to("mgpu")
    bad = x.index_select(0, torch.tensor([0, 9]).to("mgpu"))  # out of range: only the data says so
    y, y_cpu = x, x_cpu
    for _ in range(40):  # enough to start flights while `bad` is pending
        y, y_cpu = y * 1.5, y_cpu * 1.5
    with pytest.raises((IndexError, RuntimeError), match="out of range|index"):
        torch_mgpu.synchronize()
    assert torch.equal(y.cpu(), y_cpu)  # the rest computed
    with pytest.raises(RuntimeError, match="lost|out of range|index"):
        bad.cpu()
    assert torch.equal((x + 1).cpu(), x_cpu + 1)  # inputs stay usable
    torch_mgpu.synchronize()  # the error was reported once


@pytest.mark.parametrize("change", ["default_dtype", "default_dtype_twice"])
def test_a_setting_changed_under_a_flight_does_not_reach_its_ops(async_ops, change):
    # sin of an int32 tensor computes in the default dtype: under float32 at
    # the call. The flight starts at the third op (slow products first), and
    # the program changes the default dtype while it runs (fuzzer seed
    # 905638): the flight's sin must still compute as eager's did.
    async_ops(3)
    a = torch.randn(600, 600)
    i = torch.tensor([1_000_000_007, 123_456_789, 987_654_321], dtype=torch.int32)
    want = i.sin()
    am, im = a.to("mgpu"), i.to("mgpu")
    torch_mgpu.synchronize()
    m = am @ am
    m = m @ am
    s = im.sin()
    torch.set_default_dtype(torch.float64)
    try:
        if change == "default_dtype_twice":
            torch.set_default_dtype(torch.float32)
            torch.set_default_dtype(torch.float64)
        after = im.sin()  # a new graph, under float64
        got = s.cpu()
        assert after.dtype == torch.float64
        assert torch.equal(after.cpu(), i.sin())
    finally:
        torch.set_default_dtype(torch.float32)
    assert got.dtype == want.dtype and torch.equal(got, want)
    torch.testing.assert_close(m.cpu(), a @ a @ a, rtol=1e-4, atol=1e-2)


def test_setting_changes_wait_for_the_flight_in_python_and_cpp():
    # torch's setters are torch_mgpu's thin wrappers (they keep name and docs).
    for name in ("set_default_dtype", "use_deterministic_algorithms", "set_float32_matmul_precision"):
        fn = getattr(torch, name)
        assert fn._mgpu_waits_for_flight and fn.__name__ == name and fn.__doc__
    import torch.utils.deterministic as det
    assert type(det).fill_uninitialized_memory.fset._mgpu_waits_for_flight
    before = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = not before
    assert det.fill_uninitialized_memory == (not before)
    det.fill_uninitialized_memory = before
    torch_mgpu._C._wait_for_flight()  # nothing in flight: returns


def test_random_ops_stay_deterministic(async_ops):
    def run():
        torch.manual_seed(7)
        x = torch.randn(32, 32, device="mgpu")
        drop = torch.nn.Dropout(0.3)  # draws from the global generator
        for _ in range(10):
            x = drop(torch.tanh(x @ x.t() * 0.1)) + torch.rand(32, 32, device="mgpu")
        for _ in range(30):
            x = x * 1.01 + torch.randn(32, 32, device="mgpu") * 0.01
        return x.cpu()

    async_ops(0)
    expected = run()
    async_ops(8)
    assert torch.equal(run(), expected)
    assert torch.equal(run(), expected)
    # The host's generator is not disturbed by mgpu work, whenever it runs.
    torch.manual_seed(3)
    host_draws = torch.rand(4)
    torch.manual_seed(3)
    x = torch.randn(8, device="mgpu")
    for _ in range(40):
        x = torch.nn.functional.dropout(x, 0.1) * 1.01
    assert torch.equal(torch.rand(4), host_draws)
    x.cpu()


def test_training_loop_matches_cpu(async_ops):
    async_ops(24)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model_m = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model_m.load_state_dict(model.state_dict())
    model_m.to("mgpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_m = torch.optim.SGD(model_m.parameters(), lr=0.1, momentum=0.9)
    data = [(torch.randn(8, 12), torch.randn(8, 3)) for _ in range(6)]
    for x, t in data:
        for m, o, dev in ((model, opt, "cpu"), (model_m, opt_m, "mgpu")):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x.to(dev)), t.to(dev))
            loss.backward()
            o.step()
    for p, pm in zip(model.parameters(), model_m.parameters()):
        torch.testing.assert_close(pm.cpu(), p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_random_dags_with_flights_match_eager(async_ops, seed):
    rng = random.Random(100 + seed)
    async_ops(rng.choice([4, 8, 16]))
    check_random_dag(rng, seed, lanes=[1, 2], n_ops=(30, 80))


def test_threads_capture_while_flights_run(async_ops):
    async_ops(16)
    capture_in_threads(3, steps=60, size=16, scale=0.1)


def test_simulate_plans_what_is_pending(async_ops):
    async_ops(0)
    x = torch.randn(16, 16).to("mgpu")
    ys = [torch.tanh(x @ x) for _ in range(100)]
    assert len(torch_mgpu.simulate(devices=2).plan) == 200
    torch_mgpu.synchronize()
    async_ops(64)
    ys = [torch.tanh(x @ x) for _ in range(100)]
    # Part of it already ran in the background: only the rest is planned.
    assert len(torch_mgpu.simulate(devices=2).plan) < 200
    del ys


def _stacks_of(pid):
    """The native stacks of a hung process, where gdb is at hand (what a
    failure report needs to say which lock it waits for)."""
    import shutil
    import subprocess

    if not shutil.which("gdb"):
        return "(no gdb to show them)"
    try:
        out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"],
                             capture_output=True, text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return "(gdb timed out)"
    return "\n".join(line for line in out.splitlines() if line.startswith(("#", "Thread")))[:20000]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_computes_on_the_calling_thread(async_ops):
    # Lane workers and the background worker do not survive fork(): a child
    # (a DataLoader worker, say) still computes, on one lane, in the foreground.
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="heft")
    async_ops(8)
    x = torch.randn(16, 16)
    xm = x.to("mgpu")
    torch_mgpu.synchronize()
    pending = [torch.tanh(xm @ xm) + i for i in range(3)]  # recorded before the fork
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        code = 3
        try:
            ys = [torch.tanh(xm @ xm) * i for i in range(40)]  # would start flights
            ok = all(torch.allclose(y.cpu(), torch.tanh(x @ x) * i) for i, y in enumerate(ys))
            ok = ok and all(torch.allclose(p.cpu(), torch.tanh(x @ x) + i) for i, p in enumerate(pending))
            ok = ok and torch_mgpu.last_plan().lanes_used == 1
            code = 0 if ok else 2
        finally:
            os._exit(code)
    deadline = time.time() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.time() > deadline:
            stacks = _stacks_of(pid)
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the forked child hung; its threads:\n" + stacks)
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    for i, p in enumerate(pending):  # the parent is unaffected
        torch.testing.assert_close(p.cpu(), torch.tanh(x @ x) + i)


_FORK_WHILE_MEASURING = r"""
import os, sys, threading, time
import torch, torch_mgpu
torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="heft")
if len(sys.argv) > 2:
    # The sanitizer's allocator serves the measurement's tensors: fork must
    # wait for the measurement before it takes that allocator's lock.
    torch_mgpu._C._stream_sanitizer_start()
x = torch.randn(16, 16)
xm = x.to("mgpu")
# The process's first plan measures the cost model (tens of ms): fork while a
# background flight (or another thread) is doing so.
if sys.argv[1] == "flight":
    torch_mgpu.set_async_ops(4)
    pending = [torch.tanh(xm @ xm) + i for i in range(3)]
else:
    threading.Thread(target=torch_mgpu._C._cost_model).start()
    time.sleep(float(sys.argv[1]))
pid = os.fork()
if pid == 0:
    code = 3
    try:
        ys = [torch.tanh(xm @ xm) * i for i in range(5)]
        ok = all(torch.allclose(y.cpu(), torch.tanh(x @ x) * i) for i, y in enumerate(ys))
        # fork() waited for the measurement in progress: the child has its model.
        code = 0 if ok and torch_mgpu._C._cost_model()["calibrated"] else 2
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("when", ["flight", "0", "0.02", "0 sanitizer", "0.02 sanitizer"])
def test_fork_while_the_cost_model_is_measured(when):
    # A fresh interpreter, so the measurement really is the process's first.
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _FORK_WHILE_MEASURING, *when.split()], start_new_session=True)
    try:
        assert proc.wait(timeout=120) == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the parent and its hung child
        proc.wait()
        pytest.fail("the forked child hung")


def test_no_memory_growth_with_flights(async_ops):
    async_ops(8)
    x = torch.randn(256, 256, device="mgpu")

    def cycle():
        y = x
        for _ in range(15):
            y = torch.tanh(y * 0.5) + 1
        return y.sum().item()

    for _ in range(20):
        cycle()
    # With tier 1 on (TORCH_MGPU_COMPILE), its one compile of the hot graph
    # (inductor's own memory) happens before the steady state measured here.
    torch_mgpu.wait_for_compiles()
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    flushes = torch_mgpu.stats()["background_flushes"]
    for _ in range(150):
        cycle()
    gc.collect()
    growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert torch_mgpu.stats()["background_flushes"] - flushes >= 150
    assert growth_mib < 20, f"max RSS grew {growth_mib:.1f} MiB over 150 cycles with flights"
