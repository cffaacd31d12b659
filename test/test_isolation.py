"""Failure isolation: a call that raises records nothing; an op that fails at
a sync is raised once, by that sync, naming the op and the line that called
it; its outputs raise a clear error when read; nothing else changes. Every
op runs under the settings of its call (the default dtype and friends), and
checks that do not depend on the data raise at the call, as in eager, even
when the result is never read. Each on one lane, several lanes, virtual
devices and background flights."""
import os
import random
import re

import pytest
import torch

import torch_mgpu
from conftest import assert_same, async_ops, restore_lanes
from torch_mgpu import _C

HERE = os.path.basename(__file__)

CONFIGS = {
    # name: (configure kwargs, async ops)
    "one_lane": (dict(devices=["cpu"], lanes_per_device=1), 0),
    "two_lanes": (dict(devices=["cpu"], lanes_per_device=2, policy="heft"), 0),
    "virtual_devices": (dict(devices=["cpu", "cpu"], lanes_per_device=1, policy="heft"), 0),
    "flights": (dict(devices=["cpu"], lanes_per_device=2, policy="heft"), 2),
}


@pytest.fixture(params=sorted(CONFIGS))
def config(request):
    kwargs, n_async = CONFIGS[request.param]
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(**kwargs)
    try:
        with async_ops(n_async):
            yield request.param
            torch_mgpu.synchronize()
    finally:
        _C._inject_fault("node", 0)
        restore_lanes(*before)


def raises_like_eager(fn_cpu, fn_mgpu):
    """Both raise, the same Python class; returns the mgpu exception."""
    with pytest.raises(Exception) as eager:
        fn_cpu()
    with pytest.raises(Exception) as lazy:
        fn_mgpu()
    assert type(lazy.value) is type(eager.value), (lazy.value, eager.value)
    return lazy.value


# Calls that eager refuses at the call, from a Meta kernel, a kernel's own
# argument check or a dtype rule: (name, fn(device) -> None).
def _mm_dtypes(d):
    torch.mm(torch.ones(2, 2, dtype=torch.long, device=d), torch.ones(2, 2, device=d))


def _alpha_on_bool(d):
    a = torch.tensor([True, False], device=d)
    torch.add(a, a, alpha=1.1)


def _out_dtype(d):
    torch.neg(torch.randn(3, device=d), out=torch.empty(3, dtype=torch.long, device=d))


def _shape_mismatch(d):
    torch.randn(2, 3, device=d) + torch.randn(4, device=d)


def _index_out_of_range(d):
    x = torch.randn(3, device=d)
    x[torch.tensor([5])] = 1.0


def _median_of_nothing(d):
    torch.empty(0, 2, device=d).median(0)


def _value_overflows_half(d):
    torch.zeros(3, dtype=torch.float16, device=d).fill_(1e10)  # a plain std::runtime_error in the kernel


def _complex_into_integers(d):
    torch.arange(4, device=d)[torch.tensor([-1, 0])] = 0.7 - 0.2j


# The same checks on calls too large to run in full when first seen (their
# dtype checks run over a cut copy; a cut that fails runs in full).
def _large_mm_dtypes(d):
    torch.mm(torch.ones(300, 200, dtype=torch.long, device=d), torch.ones(200, 100, device=d))


def _large_alpha_on_bool(d):
    a = torch.ones(40000, dtype=torch.bool, device=d)
    torch.add(a, a, alpha=1.1)


def _large_out_dtype(d):
    torch.neg(torch.randn(200, 100, device=d), out=torch.empty(200, 100, dtype=torch.long, device=d))


def _large_value_overflows_half(d):
    torch.zeros(300, 100, dtype=torch.float16, device=d).fill_(1e10)


def _large_where_dtypes(d):
    # An index past the cut copy's rows: the full run decides.
    torch.randn(300, 100, device=d).index_add(0, torch.tensor([299]), torch.ones(1, 100, dtype=torch.long, device=d))


REFUSED = [_mm_dtypes, _alpha_on_bool, _out_dtype, _shape_mismatch, _index_out_of_range, _median_of_nothing,
           _value_overflows_half, _complex_into_integers, _large_mm_dtypes, _large_alpha_on_bool, _large_out_dtype,
           _large_value_overflows_half, _large_where_dtypes]


@pytest.mark.parametrize("call", REFUSED, ids=lambda f: f.__name__.strip("_"))
def test_checks_that_do_not_depend_on_data_raise_at_the_call(config, call):
    # Even when the result is dropped: nothing is left to raise at a sync.
    raises_like_eager(lambda: call("cpu"), lambda: call("mgpu"))
    assert torch.equal((torch.ones(2, device="mgpu") + 1).cpu(), torch.full((2,), 2.0))
    torch_mgpu.synchronize()


def test_large_calls_whose_cut_copy_fails_run_as_eager(config):
    # Views, expansions and host indices fit the real shapes, not the cut
    # ones: those calls are recorded as usual and give eager's values.
    x_cpu = torch.randn(300, 100)
    x = x_cpu.to("mgpu")
    before = torch_mgpu.stats()["ops_captured"]
    got = [x.view(100, 300), x.t().reshape(-1)[:5000].unfold(0, 50, 25), x[:, :1].expand(300, 400),
           x[torch.tensor([299, 7])], x.narrow(1, 60, 40), torch.cat([x, x])]
    want = [x_cpu.view(100, 300), x_cpu.t().reshape(-1)[:5000].unfold(0, 50, 25), x_cpu[:, :1].expand(300, 400),
            x_cpu[torch.tensor([299, 7])], x_cpu.narrow(1, 60, 40), torch.cat([x_cpu, x_cpu])]
    assert torch_mgpu.stats()["ops_captured"] > before
    for g, w in zip(got, want):
        assert_same(g, w)


def test_a_call_that_raises_records_nothing(config):
    x_cpu = torch.randn(4, 3)
    x = x_cpu.to("mgpu")
    y = x * 2
    b = torch.tensor([True, False, True], device="mgpu")
    w = torch.randn(3, device="mgpu", requires_grad=True)
    torch_mgpu.synchronize()
    before = (torch_mgpu.pending_ops(), x._version, y._version, b._version, b.requires_grad, b.grad_fn)
    with pytest.raises(RuntimeError, match="can't be cast"):
        b.mul_(w)  # a float result into a bool tensor: no autograd node, no version
    with pytest.raises(RuntimeError):
        y.add_(torch.randn(5, device="mgpu"))  # broadcast refused: y keeps its shape and value
    with pytest.raises(RuntimeError):
        torch.neg(x, out=torch.empty(2, dtype=torch.long, device="mgpu"))
    assert (torch_mgpu.pending_ops(), x._version, y._version, b._version, b.requires_grad, b.grad_fn) == before
    assert torch.equal(y.cpu(), x_cpu * 2)
    assert torch.equal(b.cpu(), torch.tensor([True, False, True]))


def test_complex_fill_records_once(config):
    z = torch.zeros(2, dtype=torch.complex64, device="mgpu")
    z.fill_(1 + 2j)
    torch_mgpu.synchronize()
    assert torch_mgpu.pending_ops() == 0
    assert torch.equal(z.cpu(), torch.full((2,), 1 + 2j, dtype=torch.complex64))
    assert torch.equal(torch.full((2,), 1j, device="mgpu").cpu(), torch.full((2,), 1j))
    assert torch.equal((torch.ones(2, device="mgpu") + 1).cpu(), torch.full((2,), 2.0))


def _failing_gather(x):
    """A data-dependent failure: an index the Meta kernel cannot check."""
    idx = torch.tensor([0, 7], device=x.device)
    return torch.index_select(x, 0, idx)  # the line errors must name


def test_failed_op_raised_once_and_named(config):
    x_cpu = torch.randn(3, 2)
    x = x_cpu.to("mgpu")
    ok = (x * 3).sum(0)
    bad = _failing_gather(x)
    with pytest.raises(IndexError) as info:
        torch_mgpu.synchronize()
    message = str(info.value)
    assert "aten::index_select" in message
    assert re.search(re.escape(HERE) + r":\d+", message), message
    torch_mgpu.synchronize()  # once: a later sync of other work does not raise it again
    assert torch.equal(ok.cpu(), (x_cpu * 3).sum(0))
    assert torch.equal((x + 1).cpu(), x_cpu + 1)
    with pytest.raises(RuntimeError, match="lost.*index_select"):
        bad.cpu()
    with pytest.raises(RuntimeError, match="index_select"):
        (bad + 1).cpu()  # reading it in a new op names the op too
    torch_mgpu.synchronize()


@pytest.mark.parametrize("name", ["one_lane", "two_lanes", "virtual_devices"])
def test_in_place_writes_recorded_after_a_failed_one_keep_the_tensor_as_it_was(name):
    # README: ops of the same graph recorded after a failed op that read
    # what it wrote do not run; a tensor written in place keeps its value
    # from before them all, through views taken before the failure too
    # (fuzzer seed 1005900). Ops recorded after the sync run on that value.
    kwargs, _ = CONFIGS[name]
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(**kwargs)
    try:
        with async_ops(0):
            x_cpu = torch.randn(4)
            x = x_cpu.to("mgpu")
            view = x[1:]
            other_cpu = torch.randn(4)
            other = other_cpu.to("mgpu")
            x[torch.tensor([7], device="mgpu")] = 0.5
            x += x
            view.relu_()
            other.mul_(2)
            with pytest.raises(IndexError, match="_index_put_impl_"):
                torch_mgpu.synchronize()
            assert torch.equal(x.cpu(), x_cpu)
            assert torch.equal(view.cpu(), x_cpu[1:])
            assert torch.equal(other.cpu(), other_cpu * 2)  # work that did not read it ran
            x += x  # a new graph: runs on the value kept
            assert torch.equal(x.cpu(), x_cpu * 2)
    finally:
        restore_lanes(*before)


def test_unrelated_work_and_autograd_after_a_failure(config):
    w_cpu = torch.randn(4, 4, requires_grad=True)
    w = w_cpu.detach().to("mgpu").requires_grad_()
    y = torch.randn(4, device="mgpu")
    with pytest.raises(RuntimeError, match="more than one element"):
        y[:1].expand(3).bernoulli_(0.5)  # internal overlap: refused at the call or (random ops) at the sync
        torch_mgpu.synchronize()
    torch_mgpu.synchronize()  # once
    loss = (w @ w).tanh().sum()
    (g,) = torch.autograd.grad(loss, w)
    (g_cpu,) = torch.autograd.grad((w_cpu @ w_cpu).tanh().sum(), w_cpu)
    torch.testing.assert_close(g.cpu(), g_cpu)


def test_failure_inside_a_flight_is_raised_once():
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2)
    try:
        with async_ops(1):
            x = torch.randn(3, device="mgpu")
            bad = _failing_gather(x)  # starts a flight that fails
            with pytest.raises(IndexError, match="index_select"):
                torch_mgpu.synchronize()
            torch_mgpu.synchronize()
            assert torch.equal((x * 0 + 1).cpu(), torch.ones(3))
            with pytest.raises(RuntimeError, match="lost"):
                bad.cpu()
    finally:
        restore_lanes(*before)


def test_failed_out_write_that_grew_its_tensor_is_lost_not_garbage(config):
    values = torch.empty(0, device="mgpu")
    indices = torch.empty(0, dtype=torch.long, device="mgpu")
    torch.index_select(torch.randn(3, device="mgpu"), 0, torch.tensor([9], device="mgpu"), out=values)
    with pytest.raises(IndexError):
        torch_mgpu.synchronize()
    with pytest.raises(RuntimeError, match="lost"):
        values.cpu()  # never bytes the op did not write
    assert indices.cpu().numel() == 0


# Every op runs with the settings of its call.
def test_default_dtype_is_the_calls(config):
    prev = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        a = torch.tensor([1, 2], device="mgpu")
        y = torch.true_divide(a, 3)
        r = torch.arange(0.0, 3, device="mgpu") / 7
        torch.set_default_dtype(torch.bfloat16)
        z = a * 0.5
        torch.set_default_dtype(torch.float32)
        assert y.dtype == torch.float64 and z.dtype == torch.bfloat16
        torch.set_default_dtype(torch.float64)
        ref_y = torch.true_divide(torch.tensor([1, 2]), 3)
        ref_r = torch.arange(0.0, 3) / 7
        torch.set_default_dtype(torch.bfloat16)
        ref_z = torch.tensor([1, 2]) * 0.5
        torch.set_default_dtype(torch.float32)
        assert torch.equal(y.cpu(), ref_y)
        assert torch.equal(r.cpu(), ref_r)
        assert torch.equal(z.cpu(), ref_z)
    finally:
        torch.set_default_dtype(prev)


def _matmul_precision_program(a, b):
    """Products under "highest" and "medium" (bfloat16 on CPUs that have it),
    with elementwise ops (which read no precision) recorded between the
    changes."""
    out = []
    torch.set_float32_matmul_precision("highest")
    p = a @ b
    out.append(p)
    torch.set_float32_matmul_precision("medium")
    q = p * 0.5 + a  # elementwise under "medium": the products' settings stay theirs
    out.append(q @ b)
    torch.set_float32_matmul_precision("highest")
    out.append(q.relu() - 1.0)
    out.append(q @ b)
    torch.set_float32_matmul_precision("medium")
    out.append(torch.addmm(q, a, b))
    return out


def test_matmul_precision_is_each_products_call(config):
    a_cpu, b_cpu = torch.randn(256, 256), torch.randn(256, 256)  # large enough for oneDNN's bfloat16 path
    prev = torch.get_float32_matmul_precision()
    try:
        want = _matmul_precision_program(a_cpu, b_cpu)
        got = _matmul_precision_program(a_cpu.to("mgpu"), b_cpu.to("mgpu"))
        torch.set_float32_matmul_precision(prev)
        got = [g.cpu() for g in got]
    finally:
        torch.set_float32_matmul_precision(prev)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # Where this CPU multiplies float32 in bfloat16 under "medium", the
    # check above told the settings apart.
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not torch.equal(want[1], want[3])


def test_signature_cache_sees_the_default_dtype(config):
    prev = torch.get_default_dtype()
    try:
        a = torch.tensor([1, 2], device="mgpu")
        for dtype in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            assert (a / 2).dtype == dtype
            assert (a * 0.5).dtype == dtype
            assert torch.arange(0.0, 3, device="mgpu").dtype == dtype
            assert torch.equal((a / 2).cpu(), torch.tensor([1, 2]) / 2)
    finally:
        torch.set_default_dtype(prev)


def test_autocast_at_the_sync_does_not_apply_again(config):
    a_cpu, b_cpu = torch.randn(8, 8), torch.randn(8, 8)
    c = a_cpu.to("mgpu") @ b_cpu.to("mgpu")  # recorded outside autocast: float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = c.cpu()  # the sync runs inside an autocast region
    assert got.dtype == torch.float32
    assert torch.equal(got, a_cpu @ b_cpu)


# The property: a failure changes nothing that does not depend on it.
UNARY = {"sin", "tanh", "t"}


def _random_program(rng, n):
    """Statements over a pool of values; one `sin` (the op made to fail).
    Returns the statements and, for each, the statements it depends on."""
    stmts, deps = [], []
    fail_at = rng.randrange(n // 3, n)
    for k in range(n):
        if k == fail_at:
            i = rng.randrange(k + 2)
            stmts.append(("sin", i, i))
        else:
            stmts.append((rng.choice(["add", "mul", "tanh", "mm", "add_", "t"]), rng.randrange(k + 2),
                          rng.randrange(k + 2)))
    for k, (op, i, j) in enumerate(stmts):
        d = {k}
        for v in ((i,) if op in UNARY else (i, j)):
            if v >= 2:
                d |= deps[v - 2]
        deps.append(d)
    return stmts, deps, fail_at


def _apply(stmt, pool):
    op, i, j = stmt
    x, y = pool[i], pool[j]
    if op == "sin":
        return torch.sin(x)
    if op == "add":
        return x + y
    if op == "mul":
        return x * y * 0.5
    if op == "tanh":
        return torch.tanh(x)
    if op == "mm":
        return torch.tanh(x @ y)
    if op == "add_":
        return x.clone().add_(y, alpha=0.25)
    return x.t()


def _run_program(stmts, inputs):
    pool = [t.clone() for t in inputs]
    for stmt in stmts:
        pool.append(_apply(stmt, pool))
    return pool[len(inputs):]


@pytest.mark.parametrize("seed", range(6))
def test_injected_failures_change_only_what_depends_on_them(config, seed):
    rng = random.Random(seed)
    stmts, deps, fail_at = _random_program(rng, 14)
    inputs = [torch.randn(6, 6) for _ in range(2)]
    expected = _run_program(stmts, inputs)
    before = torch.ones(3, device="mgpu") * 2  # pending work of another part of the program
    _C._inject_fault("node", 1, "aten::sin")
    # Statement by statement: with background flights the failure may
    # surface while the program is still recording, at a statement that
    # reads the lost value (a sync point of its own); never at another.
    pool = [t.to("mgpu") for t in inputs]
    raised = []  # the failure itself, raised once
    for k, stmt in enumerate(stmts):
        if any(pool[v] is None for v in stmt[1:]):  # reads what a statement before could not give
            assert fail_at in deps[k]
            pool.append(None)
            continue
        try:
            pool.append(_apply(stmt, pool))
        except RuntimeError as e:
            assert fail_at in deps[k] and "aten::sin" in str(e), (k, e)
            raised += [] if "was lost" in str(e) else ["fault"]  # reading a lost value may raise often
            pool.append(None)
    try:
        torch_mgpu.synchronize()
    except RuntimeError as e:
        assert "injected fault" in str(e) and "aten::sin" in str(e) and "was lost" not in str(e), e
        raised.append("fault")
    assert raised == ["fault"]
    _C._inject_fault("node", 0)
    torch_mgpu.synchronize()
    assert torch.equal(before.cpu(), torch.full((3,), 2.0))
    outs = pool[len(inputs):]
    for k, (got, want) in enumerate(zip(outs, expected)):
        if fail_at in deps[k]:
            if got is not None:
                with pytest.raises(RuntimeError, match="aten::sin"):
                    got.cpu()
        else:
            torch.testing.assert_close(got.cpu(), want)


def test_sync_each_op_raises_at_the_call_that_failed():
    # TORCH_MGPU_SYNC=op, as CUDA_LAUNCH_BLOCKING=1: the traceback points at the op.
    import subprocess
    import sys
    code = ("import torch, torch_mgpu\n"
            "x = torch.randn(3, device='mgpu')\n"
            "idx = torch.tensor([0, 7], device='mgpu')\n"
            "try:\n"
            "    y = torch.index_select(x, 0, idx)\n"
            "    print('recorded')\n"
            "except IndexError as e:\n"
            "    print('raised at the call:', 'index_select' in str(e))\n"
            "print(torch.equal((x + 1).cpu(), x.cpu() + 1))\n")
    env = dict(os.environ, TORCH_MGPU_SYNC="op")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["raised at the call: True", "True"], out.stdout
    env["TORCH_MGPU_SYNC"] = "sometimes"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "TORCH_MGPU_SYNC: unknown value 'sometimes'" in out.stdout + out.stderr


def test_of_two_failures_the_one_called_first_is_raised(config):
    # Whatever order the lanes ran them in: eager would have stopped at the first.
    x = torch.randn(4, device="mgpu")
    first = torch.index_select(x, 0, torch.tensor([9], device="mgpu"))
    second = torch.gather(x * 2, 0, torch.tensor([-20], device="mgpu"))
    with pytest.raises((IndexError, RuntimeError), match="index_select"):
        torch_mgpu.synchronize()
    torch_mgpu.synchronize()
    for lost, op in ((first, "index_select"), (second, "gather")):
        with pytest.raises(RuntimeError, match=f"lost.*{op}"):
            lost.cpu()
