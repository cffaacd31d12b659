"""Pointwise fusion: runs of elementwise arithmetic on a lane execute as one
pass. Results must equal eager PyTorch bitwise; what is not fusable runs as
before."""
import os
import random
import subprocess
import sys

import pytest
import torch

import torch_mgpu

# What nodes do on the lanes: tier 0, whatever the default (conftest).
pytestmark = pytest.mark.usefixtures("node_by_node")


@pytest.fixture
def no_async():
    """One graph per sync, on one lane: what is fused does not depend on the
    plan the cost model picks (the lane tests below cover several lanes)."""
    saved = torch_mgpu.async_ops(), torch_mgpu.policy()
    torch_mgpu.set_async_ops(0)
    torch_mgpu.configure(policy="serial")
    yield
    torch_mgpu.set_async_ops(saved[0])
    torch_mgpu.configure(policy=saved[1])


@pytest.fixture
def lanes_config():
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    yield
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=len(before[0]), policy=before[1])


def exact(got, want):
    """Bitwise equal, NaNs included."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def run_both(fn, *inputs):
    want = fn(*inputs)
    got = fn(*[t.to("mgpu") for t in inputs])
    if isinstance(want, torch.Tensor):
        want, got = (want,), (got,)
    got = [g.cpu() for g in got]
    for g, w in zip(got, want):
        exact(g, w)
    return torch_mgpu.last_plan()


def scalar_mix(x, y):
    a = x * 1.0001 + 0.0001       # Python float scalars (wrapped numbers)
    b = 2 - a                     # scalar first (rsub)
    c = b / y - x * 3             # int scalar, tensor / tensor
    d = -c / 7.5
    e = d * torch.tensor(0.3, dtype=torch.float64) + torch.tensor(2)  # 0-dim CPU tensors
    return (e / (a * a + 1.5)).relu() - e


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 3 * 1024 + 5, 100_003])
def test_fused_chain_equals_eager_bitwise(no_async, dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g, dtype=dtype)
    y = torch.randn(n, generator=g, dtype=dtype)
    plan = run_both(scalar_mix, x, y)
    assert plan.fused_nodes == len(plan)  # all of it ran in fused passes


def test_shapes_and_special_values(no_async):
    x = torch.randn(3, 5, 7)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    y = torch.randn(3, 5, 7)
    y[0, 0, :3] = 0.0
    plan = run_both(lambda a, b: (a / b) * 2 - (-a) / 0.0 + b, x, y)
    assert plan.fused_nodes == len(plan)


def test_relu_keeps_signed_zeros_and_nans(no_async):
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-40, -1e-40])
    x = torch.cat([special, torch.randn(100)])

    def f(a):
        return torch.relu(a * 1.0), torch.relu(a - 0.0) * -1.0, -torch.relu(-a)
    plan = run_both(f, x)
    assert plan.fused_nodes == len(plan)
    got = [t.cpu() for t in f(x.to("mgpu"))]
    for g, w in zip(got, f(x)):  # the sign bits too (0.0 == -0.0 for assert_close)
        assert torch.equal(torch.signbit(g), torch.signbit(w))


def test_long_chain_is_one_pass(no_async):
    def chain(x):
        for _ in range(300):
            x = x * 1.0001
            x = x + 0.0001
        return x
    plan = run_both(chain, torch.randn(64))
    assert plan.fused_nodes == 600 and len(plan) == 600


def test_intermediates_read_elsewhere_are_kept(no_async):
    def f(x, y):
        a = x * 2 + 1          # read by tanh below: materialized
        b = a * a - y
        c = torch.tanh(a)      # not fusable: ends the run
        d = b / 3 + c          # a second run reads b and c
        return d, b
    plan = run_both(f, torch.randn(40, 40), torch.randn(40, 40))
    ops = [e["op"] for e in plan.timeline()]
    assert "aten::tanh" in ops
    assert plan.fused_nodes >= 4
    assert all(e["fused"] == -1 for e in plan.timeline() if e["op"] == "aten::tanh")


def test_a_root_in_the_middle_of_a_run(no_async):
    x = torch.randn(100)
    xm = x.to("mgpu")
    a = xm * 3
    b = a + 1
    c = b * b
    exact(c.cpu(), (x * 3 + 1) * (x * 3 + 1))
    assert torch_mgpu.last_plan().fused_nodes == 3
    exact(a.cpu(), x * 3)          # kept: a live tensor
    exact(b.cpu(), x * 3 + 1)


def test_not_fusable_runs_alone_and_correct(no_async):
    x = torch.randn(16, 16)
    h = torch.randn(16, 16).half()
    i = torch.randint(-5, 5, (16, 16))
    cases = [
        (lambda a: torch.add(a, a * 2, alpha=0.5) * 3, x),  # alpha != 1 (eager uses fma): only the mul fuses
        (lambda a: a.t() * 2 + 1, x),                       # non-contiguous input of the first op
        (lambda a: a * a[:, :1].t() + 1, x),                # broadcast of a strided view
        (lambda a: a * 2 + 1, h),                           # half
        (lambda a: a * 2 + 1, i),                           # integers
        (lambda a: a / 2 + 1, i),                           # int -> float promotion
        (lambda a: a.clone().mul_(2).add_(1), x),           # in place
    ]
    for fn, t in cases:
        plan = run_both(fn, t)
        assert plan.fused_nodes == 0, (plan, fn)


def test_tensor_constants_follow_their_values_with_a_cached_plan(no_async):
    x = torch.randn(256)
    xm = x.to("mgpu")
    hits = torch_mgpu.stats()["plan_cache_hits"]
    for step in range(4):
        lr = torch.tensor(0.1 * (step + 1), dtype=torch.float64)
        exact((xm * lr + 1).cpu(), x * lr + 1)
    assert torch_mgpu.stats()["plan_cache_hits"] - hits >= 3
    assert torch_mgpu.last_plan().fused_nodes == 2


def test_python_scalars_follow_their_values_with_a_cached_plan(no_async):
    # Float arguments that change every step (a foreach op's scalars, as
    # Adam's step sizes; alpha, clamp's bounds) keep the graph's hash: the
    # cached plan runs with each step's values. (A Python number an op
    # takes as a tensor, `x * lr`, is a tensor constant: hashed by shape
    # and dtype.)
    x, y = torch.randn(256), torch.randn(256)
    xm, ym = x.to("mgpu"), y.to("mgpu")

    def program(a, b, lr, bias):
        s = torch.add(a, b, alpha=lr).clamp(-bias, bias) * 1.5
        outs = [s, a.clone()]
        torch._foreach_addcdiv_(outs, [b, s], [s.abs() + 1, b.abs() + 1], [lr, bias])
        return outs

    for got, want in zip(program(xm, ym, 0.3, 0.7), program(x, y, 0.3, 0.7)):
        torch.testing.assert_close(got.cpu(), want)
    s0 = torch_mgpu.stats()
    for step in range(4):
        lr, bias = 0.1 * 0.9 ** step, 1 - 0.99 ** (step + 1)
        for got, want in zip(program(xm, ym, lr, bias), program(x, y, lr, bias)):
            torch.testing.assert_close(got.cpu(), want)
    s1 = torch_mgpu.stats()
    assert s1["plans_built"] == s0["plans_built"]
    assert s1["plan_cache_hits"] - s0["plan_cache_hits"] >= 4


def test_an_alpha_of_one_and_another_alpha_are_different_plans(no_async):
    # Fusion takes add's alpha only when it is 1: a plan fused for alpha=1
    # must not run a call with alpha=2 (their hashes differ by the class).
    a, b = torch.randn(256), torch.randn(256)
    am, bm = a.to("mgpu"), b.to("mgpu")
    for alpha in (1.0, 2.0, 1.0, 0.5, 2.0):
        exact((torch.add(am, bm, alpha=alpha) * 3.0).cpu(), torch.add(a, b, alpha=alpha) * 3.0)


def test_failed_input_surfaces_and_later_work_runs(no_async):
    x = torch.randn(8, 8)
    xm = x.to("mgpu")
    bad = xm.index_select(0, torch.tensor([0, 100]).to("mgpu"))
    y = bad * 2 + 1
    with pytest.raises((IndexError, RuntimeError), match="index"):
        y.cpu()
    exact((xm * 2 + 1).cpu(), x * 2 + 1)
    assert torch_mgpu.last_plan().fused_nodes == 2


def test_branches_on_lanes_and_virtual_devices(no_async, lanes_config):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5000, generator=g) for _ in range(4)]

    def f(*xs):
        outs = [x * 0.5 - 1 for x in xs]
        outs = [o * o / 3 + x for o, x in zip(outs, xs)]
        return outs[0] + outs[1] * outs[2] - outs[3]
    for devices, lanes in [(["cpu"], 2), (["cpu", "cpu"], 1), (["cpu", "cpu"], 2)]:
        for policy in ["serial", "heft", "auto"]:
            torch_mgpu.configure(devices=devices, lanes_per_device=lanes, policy=policy)
            plan = run_both(f, *xs)
            assert plan.fused_nodes > 0


def random_pointwise_program(rng, n_inputs, n_ops):
    ops = [(rng.choice(["add", "sub", "mul", "div", "neg", "scalar", "rscalar", "tanh", "t"]),
            rng.randrange(10 ** 6), rng.randrange(10 ** 6), rng.uniform(-3, 3)) for _ in range(n_ops)]

    def run(inputs):
        pool = list(inputs)
        for kind, a, b, c in ops:
            x, y = pool[a % len(pool)], pool[b % len(pool)]
            if kind == "add":
                pool.append(x + y)
            elif kind == "sub":
                pool.append(x - y)
            elif kind == "mul":
                pool.append(x * y)
            elif kind == "div":
                pool.append(x / (y * y + 0.5))
            elif kind == "neg":
                pool.append(-x)
            elif kind == "scalar":
                pool.append(x * c + 0.25)
            elif kind == "rscalar":
                pool.append(c / (x * x + 1) - 1)
            elif kind == "tanh":
                pool.append(torch.tanh(x))
            else:
                pool.append(x.t().contiguous())
        return pool[len(inputs):]
    return run


@pytest.mark.parametrize("seed", range(10))
def test_random_pointwise_dags_equal_eager_bitwise(lanes_config, seed):
    rng = random.Random(seed)
    torch_mgpu.configure(devices=rng.choice([["cpu"], ["cpu", "cpu"]]), lanes_per_device=rng.choice([1, 2, 3]),
                         policy=rng.choice(["serial", "heft", "auto"]))
    saved = torch_mgpu.async_ops()
    torch_mgpu.set_async_ops(rng.choice([0, 0, 5, 17]))
    try:
        program = random_pointwise_program(rng, 3, rng.randrange(10, 60))
        g = torch.Generator().manual_seed(seed)
        inputs = [torch.randn(24, 24, generator=g, dtype=rng.choice([torch.float32, torch.float64]))
                  for _ in range(3)]
        inputs = [t.to(inputs[0].dtype) for t in inputs]
        want = program(inputs)
        got = program([t.to("mgpu") for t in inputs])
        for w, m in zip(want, got):
            exact(m.cpu(), w)
    finally:
        torch_mgpu.set_async_ops(saved)


def test_fusion_can_be_turned_off():
    code = (
        "import torch, torch_mgpu\n"
        "torch_mgpu.set_async_ops(0)\n"
        "x = torch.randn(64)\n"
        "y = (x.to('mgpu') * 3 + 1) / 2\n"
        "assert torch.equal(y.cpu(), (x * 3 + 1) / 2)\n"
        "print(torch_mgpu.last_plan().fused_nodes)\n"
    )
    outs = {}
    for flag in ["0", "1"]:
        env = dict(os.environ, TORCH_MGPU_FUSION=flag)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        outs[flag] = int(r.stdout.strip().splitlines()[-1])
    assert outs == {"0": 0, "1": 3}


def test_profiler_shows_a_fused_pass(no_async):
    x = torch.randn(64).to("mgpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (x * 2 + 1).cpu()
    assert any(e.name == "mgpu::fused_pointwise" for e in prof.events())


def test_empty_and_zero_dim_tensors(no_async):
    plan = run_both(lambda a: (a * 2 + 1) / 3, torch.randn(0, 5))
    assert plan.fused_nodes == 3
    plan = run_both(lambda a: (a * 2 + 1) / 3, torch.tensor(1.5))
    assert plan.fused_nodes == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_broadcast_operands(no_async, dtype):
    g = torch.Generator().manual_seed(11)
    n, d = 5000, 37  # periods that do not divide the blocks; large enough to split over threads
    x = torch.randn(n, d, generator=g, dtype=dtype)
    row = torch.randn(d, generator=g, dtype=dtype)          # along the leading dim (a bias)
    col = torch.randn(n, 1, generator=g, dtype=dtype)       # along the trailing dim (per-row statistics)
    one = torch.randn((), generator=g, dtype=dtype)         # a 0-dim tensor on mgpu

    def f(x, row, col, one):
        y = (row * row + 1) * (x - col) / col + row
        return (y * one - col).relu(), one - y
    plan = run_both(f, x, row, col, one)
    # row * row + 1 runs over d elements (a pass of its own); the rest over n * d
    assert plan.fused_nodes == len(plan)


def test_broadcasts_that_are_not_fused_still_match(no_async):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 4, 5, generator=g)
    mid = torch.randn(3, 1, 1, generator=g)   # channels: neither a leading nor a trailing broadcast
    plan = run_both(lambda x, m: (x * m + 1) * 2, x, mid)
    assert plan.fused_nodes == 2  # only the last two ops, which read x * m whole


def test_gmm_like_e_step(no_async):
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3000, 16, generator=g)
    means = torch.randn(4, 16, generator=g)
    log_vars = torch.randn(4, 16, generator=g) * 0.1
    log_w = torch.randn(4, generator=g)

    def e_step(x, means, log_vars, log_w):
        out = []
        for j in range(4):
            diff = x - means[j]
            out.append(log_w[j] - 0.5 * ((diff * diff) / log_vars[j].exp() + log_vars[j]).sum(1))
        return out
    plan = run_both(e_step, x, means, log_vars, log_w)
    assert plan.fused_nodes >= 16
