"""Failures during execution, injected at every node of a training step (and
at transfers), on every path a graph runs: one lane, several lanes, virtual
devices, background flights. Each must surface at the next sync point as a
Python exception, leave the process alive and every tensor readable, and
apply each recorded in-place write exactly once or not at all: the counters
that in-place ops advance (a step counter, BatchNorm's num_batches_tracked,
its running statistics) match eager replaying the ops that succeeded."""
import re

import pytest
import torch

import torch_mgpu
from conftest import restore_lanes
from torch_mgpu import _C

STEPS = 3
FAULT_STEP = 1

# Faults are injected into nodes: tier 0, whatever the default.
pytestmark = pytest.mark.usefixtures("node_by_node")


@pytest.fixture
def lanes_restored():
    before = (torch_mgpu.lanes(), torch_mgpu.policy(), torch_mgpu.async_ops())
    yield
    torch_mgpu.synchronize()
    for point in ("node", "transfer"):
        _C._inject_fault(point, 0)
    lanes, policy, async_ops = before
    restore_lanes(lanes, policy)
    torch_mgpu.set_async_ops(async_ops)


PATHS = {
    # name: (configure kwargs, async ops, fault point)
    "serial": (dict(devices=["cpu"], lanes_per_device=1, policy="serial"), 0, "node"),
    "lanes": (dict(devices=["cpu"], lanes_per_device=2, policy="heft"), 0, "node"),
    "flight": (dict(devices=["cpu"], lanes_per_device=2, policy="heft"), 3, "node"),
    "transfer": (dict(devices=["cpu", "cpu"], lanes_per_device=1, policy="heft"), 0, "transfer"),
    "transfer_flight": (dict(devices=["cpu", "cpu"], lanes_per_device=1, policy="heft"), 6, "transfer"),
}


def make_state(device):
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(64).to(device).train()
    w1 = torch.randn(64, 64).to(device)
    w2 = torch.randn(64, 64).to(device)
    counter = torch.zeros((), dtype=torch.int64).to(device)
    xs = [torch.randn(96, 64).to(device) for _ in range(STEPS)]
    return bn, w1, w2, counter, xs


def step(bn, w1, w2, counter, x):
    a = x @ w1                     # two independent branches
    b = torch.tanh(x) @ w2
    counter.add_(1)                # an in-place counter
    return bn((a + b).relu())      # running stats and num_batches_tracked, in place


def run_with_fault(path, n):
    """Runs STEPS steps on mgpu with the n-th fault point of step FAULT_STEP
    armed; returns (failing op or None, [per-step output or exception], state)."""
    kwargs, async_ops, point = PATHS[path]
    torch_mgpu.configure(**kwargs)
    torch_mgpu.set_async_ops(async_ops)
    bn, w1, w2, counter, xs = make_state("mgpu")
    torch_mgpu.synchronize()
    fired = _C._faults_fired(point)
    failing, outs = None, []
    for s in range(STEPS):
        if s == FAULT_STEP:
            _C._inject_fault(point, n)
        y = step(bn, w1, w2, counter, xs[s])
        try:
            torch_mgpu.synchronize()
        except RuntimeError as e:
            assert s == FAULT_STEP, f"an error at step {s}: {e}"
            m = re.search(r"injected fault \((\w+)(?:: ([\w:._]+))?\)", str(e))
            assert m, str(e)
            failing = m.group(2) or m.group(1)
        _C._inject_fault(point, 0)
        try:
            outs.append(y.cpu())
        except RuntimeError as e:
            assert "value was lost" in str(e), str(e)
            outs.append(e)
    if _C._faults_fired(point) == fired:
        assert failing is None
        return None, outs, (bn, counter)
    assert failing is not None, "a fault fired and no error surfaced"
    return failing, outs, (bn, counter)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_fault_position_leaves_state_as_eager_would(path, lanes_restored):
    positions = 0
    for n in range(1, 40):
        failing, outs, (bn, counter) = run_with_fault(path, n)
        if failing is None:  # past the last fault point of the step
            break
        positions += 1
        # Which writes of the failing step happened, by what failed: the
        # counter and num_batches_tracked are each written by an add_ that
        # reads nothing else; batch norm (and its running stats) needs every
        # op before it.
        counter_ran = bn_tracked_ran = True
        bn_ran = failing == "transfer" and False
        if failing.startswith("aten::add_"):
            bn_ran = True
            # Two add_ ops, one failed: the two counters tell which.
            assert int(counter.cpu()) + int(bn.num_batches_tracked.cpu()) == 2 * STEPS - 1
            counter_ran = int(counter.cpu()) == STEPS
            bn_tracked_ran = not counter_ran
        elif failing == "transfer":
            # Some value crossing devices was lost; what it fed did not run.
            bn_ran = not isinstance(outs[FAULT_STEP], Exception)
            counter_ran = int(counter.cpu()) == STEPS
            bn_tracked_ran = int(bn.num_batches_tracked.cpu()) == STEPS
        else:
            bn_ran = False  # an op on the way to batch norm failed
        # Eager replay of what succeeded.
        ebn, ew1, ew2, ecounter, exs = make_state("cpu")
        expected = []
        for s in range(STEPS):
            if s != FAULT_STEP:
                expected.append(step(ebn, ew1, ew2, ecounter, exs[s]))
                continue
            a = exs[s] @ ew1
            b = torch.tanh(exs[s]) @ ew2
            if counter_ran:
                ecounter.add_(1)
            if bn_ran:
                tracked = ebn.num_batches_tracked.clone()
                expected.append(ebn((a + b).relu()))
                ebn.num_batches_tracked.copy_(tracked)
            else:
                expected.append(None)
            if bn_tracked_ran:
                ebn.num_batches_tracked.add_(1)
        where = f"{path}: fault {n} at {failing}"
        assert int(counter.cpu()) == int(ecounter), where
        assert int(bn.num_batches_tracked.cpu()) == int(ebn.num_batches_tracked), where
        torch.testing.assert_close(bn.running_mean.cpu(), ebn.running_mean, msg=where)
        torch.testing.assert_close(bn.running_var.cpu(), ebn.running_var, msg=where)
        for s, (got, want) in enumerate(zip(outs, expected)):
            if want is None:
                assert isinstance(got, Exception), f"{where}: step {s} has a value"
            else:
                assert not isinstance(got, Exception), f"{where}: step {s}: {got}"
                torch.testing.assert_close(got, want.detach(), msg=f"{where}: step {s}")
        # Every tensor is readable, and later steps run as usual.
        for t in (bn.weight, bn.bias, bn.running_mean, counter):
            t.cpu()
    assert positions >= (1 if PATHS[path][2] == "transfer" else 5), f"{path}: only {positions} fault positions"


def test_fault_message_reaches_the_tensor_that_lost_its_value(lanes_restored):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=1, policy="serial")
    x = torch.randn(8, 8).to("mgpu")
    y = torch.tanh(x)
    _C._inject_fault("node", 1)
    with pytest.raises(RuntimeError, match=r"injected fault \(node: aten::tanh"):
        torch_mgpu.synchronize()
    with pytest.raises(RuntimeError, match="value was lost.*injected fault"):
        y.cpu()
    torch.testing.assert_close(x.cpu(), x.cpu())  # its input is intact
    assert torch.equal(torch.tanh(x).cpu(), torch.tanh(x.cpu()))  # and usable


def test_unknown_fault_point_is_refused():
    with pytest.raises(RuntimeError, match="unknown fault point 'kernel'"):
        _C._inject_fault("kernel", 1)


def test_fault_from_the_environment(tmp_path):
    import subprocess
    import sys
    code = (
        "import torch, torch_mgpu\n"
        "x = torch.randn(4, 4).to('mgpu')\n"
        "y = (x @ x).tanh()\n"
        "try:\n"
        "    y.cpu()\n"
        "except RuntimeError as e:\n"
        "    print('raised', 'injected fault' in str(e))\n"
        "print('alive', (torch.allclose if torch_mgpu.lanes()[0].startswith('cuda') else torch.equal)(x.cpu() @ x.cpu(), (x @ x).cpu()))\n"
    )
    env = dict(__import__("os").environ, TORCH_MGPU_FAULT="node:2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "raised True" in out.stdout and "alive True" in out.stdout, out.stdout


def test_an_error_left_pending_fails_the_test_that_left_it(tmp_path):
    # The autouse fixture's teardown syncs what a test left pending: an error
    # there must fail that test, not vanish.
    import shutil
    import subprocess
    import sys
    shutil.copy(__import__("os").path.join(__import__("os").path.dirname(__file__), "conftest.py"), tmp_path)
    (tmp_path / "test_leaves_error.py").write_text(
        "import torch, torch_mgpu\n"
        "from torch_mgpu import _C\n"
        "def test_leaves_a_failing_op_pending():\n"
        "    torch_mgpu.set_async_ops(0)\n"
        "    x = torch.randn(4, 4).to('mgpu')\n"
        "    globals()['y'] = torch.tanh(x)\n"
        "    _C._inject_fault('node', 1)\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, out.stdout
    assert "1 passed, 1 error" in out.stdout and "injected fault" in out.stdout, out.stdout[-3000:]
