"""Factorizations whose eager kernels check LAPACK's info on the host
(torch.linalg.cholesky, inv, solve, lu_factor, ldl_factor) are recorded as one
node each, with no sync at the call: independent branches that factorize can
run at the same time. A failed factorization raises eager's error at the sync
that runs it."""
import os
import re

import pytest
import torch

import torch_mgpu
from conftest import assert_same


@pytest.fixture
def lanes_config():
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    yield
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=len(before[0]), policy=before[1])


def spd(n, batch=(), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, n, n, generator=g, dtype=dtype)
    return a @ a.mT + n * torch.eye(n, dtype=dtype)


def rand(*shape, dtype=torch.float64, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


CASES = {
    "cholesky": lambda A, B: torch.linalg.cholesky(A),
    "cholesky_upper": lambda A, B: torch.linalg.cholesky(A, upper=True),
    "inv": lambda A, B: torch.linalg.inv(A),
    "inverse": lambda A, B: torch.inverse(A),
    "solve": lambda A, B: torch.linalg.solve(A, B),
    "solve_right": lambda A, B: torch.linalg.solve(A, B.mT),
    "lu_factor": lambda A, B: torch.linalg.lu_factor(A),
    "ldl_factor": lambda A, B: torch.linalg.ldl_factor(A),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("batch,dtype", [((), torch.float64), ((3,), torch.float32)])
def test_recorded_without_a_sync_and_equal_to_eager(name, batch, dtype):
    A, B = spd(7, batch, dtype), rand(*batch, 7, 7, dtype=dtype)
    fn = CASES[name]
    want = fn(A, B)
    Am, Bm = A.to("mgpu"), B.to("mgpu")
    torch_mgpu.synchronize()
    syncs = torch_mgpu.stats()["syncs"]
    got = fn(Am, Bm)
    assert torch_mgpu.stats()["syncs"] == syncs, "the call synchronized"
    assert torch_mgpu.pending_ops() >= 1
    if isinstance(want, torch.Tensor):
        want, got = (want,), (got,)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_failure_raises_eagers_error_at_the_sync_and_other_values_survive():
    bad = rand(5, 5)  # not positive-definite
    with pytest.raises(torch.linalg.LinAlgError) as eager:
        torch.linalg.cholesky(bad)
    m = bad.to("mgpu")
    L = torch.linalg.cholesky(m)   # no error yet: it runs at the sync
    L2 = L @ L                     # depends on the failed value
    y = m * 2 + 1                  # does not
    with pytest.raises(torch.linalg.LinAlgError) as lazy:
        y.cpu()
    # eager's message, then the op that raised it and the line that called it
    assert str(lazy.value).startswith(str(eager.value))
    assert re.search(r"raised by aten::linalg_cholesky \(op #\d+, called at .*test_linalg.py:\d+\)", str(lazy.value))
    assert_same(y, bad * 2 + 1)    # computed in the same graph, usable
    for t in (L, L2):              # reading a lost value names the failure, not a C++ backtrace
        with pytest.raises(RuntimeError, match="not positive-definite") as again:
            t.cpu()
        assert "Exception raised from" not in str(again.value)
    assert_same(m.sum(), bad.sum())  # the input is untouched and usable


def test_singular_inverse_and_solve_raise_eagers_errors():
    z = torch.zeros(4, 4)
    for fn in (torch.linalg.inv, lambda a: torch.linalg.solve(a, torch.ones(4, 2, device=a.device))):
        with pytest.raises(torch.linalg.LinAlgError) as eager:
            fn(z)
        with pytest.raises(torch.linalg.LinAlgError) as lazy:
            fn(z.to("mgpu")).cpu()
        assert str(lazy.value).startswith(str(eager.value)) and "raised by aten::linalg_" in str(lazy.value)


def test_shape_errors_raise_at_the_call():
    with pytest.raises(RuntimeError) as eager:
        torch.linalg.cholesky(torch.ones(3, 4))
    with pytest.raises(RuntimeError) as lazy:
        torch.linalg.cholesky(torch.ones(3, 4, device="mgpu"))
    assert str(lazy.value) == str(eager.value)


@pytest.mark.parametrize("name", ["cholesky", "inv", "solve", "lu_factor"])
def test_gradients_equal_eagers(name):
    fn = CASES[name]
    A, B = spd(6), rand(6, 6)

    def grads(A, B):
        A, B = A.clone().requires_grad_(), B.clone().requires_grad_()
        out = fn(A, B)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)).sum().backward()
        return A.grad, B.grad
    gA, gB = grads(A, B)
    mA, mB = grads(A.to("mgpu"), B.to("mgpu"))
    torch.testing.assert_close(mA.cpu(), gA)
    if gB is not None:
        torch.testing.assert_close(mB.cpu(), gB)


def test_no_grad_and_inference_mode_record_too():
    A = spd(5)
    Am = A.to("mgpu").requires_grad_()
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            syncs = torch_mgpu.stats()["syncs"]
            L = torch.linalg.cholesky(Am if ctx is torch.no_grad else Am.detach())
            assert torch_mgpu.stats()["syncs"] == syncs
            assert not L.requires_grad
            assert_same(L, torch.linalg.cholesky(A))


def test_independent_factorizations_run_on_two_lanes(lanes_config):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="heft")
    ks = [spd(96, seed=s) for s in range(4)]
    ys = [rand(96, 4, seed=10 + s) for s in range(4)]

    def heads(ks, ys):
        return sum(torch.cholesky_solve(y, torch.linalg.cholesky(k)).sum(0) for k, y in zip(ks, ys))
    want = heads(ks, ys)
    mks, mys = [k.to("mgpu") for k in ks], [y.to("mgpu") for y in ys]
    torch_mgpu.synchronize()
    syncs = torch_mgpu.stats()["syncs"]
    got = heads(mks, mys)
    assert torch_mgpu.stats()["syncs"] == syncs
    torch.testing.assert_close(got.cpu(), want)
    assert torch_mgpu.last_plan().lanes_used == 2


def test_cost_model_counts_factorization_flops():
    # A 256x256 Cholesky is ~n^3/3 flops: it must cost more than an
    # elementwise op over the same matrix, in the simulator's prediction.
    A = spd(256).to("mgpu")
    torch_mgpu.synchronize()
    saved = torch_mgpu.async_ops()
    torch_mgpu.set_async_ops(0)
    try:
        L = torch.linalg.cholesky(A)
        chol = torch_mgpu.simulate().makespan
        torch_mgpu.synchronize()
        E = A * 2
        elem = torch_mgpu.simulate().makespan
        torch_mgpu.synchronize()
    finally:
        torch_mgpu.set_async_ops(saved)
    cm = torch_mgpu._C._cost_model()
    # 3x the textbook count, split over at most every core of the machine
    assert chol >= 3 * (256 ** 3 / 3) / (cm["gemm_flops_per_s"] * (os.cpu_count() or 1))
    # (more than one pass over the same matrix; how much more depends on the
    # machine: its calibrated GEMM rate over its elementwise rate)
    assert chol > elem
    del L, E


# Out= tensors of another dtype: eager refuses them at the call, whatever the
# matrices hold. The call's probe runs factorizations on identities (zeros
# are singular, and their errors were taken for the data's), so that these
# raise at the call on mgpu too (solve_triangular's Meta kernel does not
# check; its error was deferred to a read of `out`, or lost with it).
@pytest.mark.parametrize("case", [
    lambda A, B, out: torch.linalg.solve_triangular(A, B, upper=True, out=out),
    lambda A, B, out: torch.triangular_solve(B, A, out=(out, torch.empty_like(A))),
    lambda A, B, out: torch.cholesky_solve(B, A, out=out),
    lambda A, B, out: torch.linalg.lu_solve(*torch.linalg.lu_factor(A), B, out=out),
    lambda A, B, out: torch.linalg.solve(A, B, out=out),
])
def test_an_out_tensor_of_another_dtype_is_refused_at_the_call(case):
    A, B = spd(3, dtype=torch.float32), rand(3, 2, dtype=torch.float32)
    with pytest.raises(RuntimeError) as eager:
        case(A, B, torch.empty(3, 2, dtype=torch.long))
    Am, Bm = A.to("mgpu"), B.to("mgpu")
    with pytest.raises(RuntimeError) as lazy:
        case(Am, Bm, torch.empty(3, 2, dtype=torch.long, device="mgpu"))
    assert str(lazy.value).splitlines()[0] == str(eager.value).splitlines()[0]
    # and with an out= tensor of the right dtype, the same values
    want = torch.empty(3, 2)
    case(A, B, want)
    got = torch.empty(3, 2, device="mgpu")
    case(Am, Bm, got)
    assert torch.allclose(got.cpu(), want, atol=1e-5), (got.cpu(), want)


EMPTY_OUT = {
    "geqrf": lambda d: torch.geqrf(torch.randn(0, 5, 5, device=d),
                                   out=(torch.empty(0, 5, 5, device=d), torch.empty(0, 5, device=d))),
    "cholesky_inverse": lambda d: torch.cholesky_inverse(torch.randn(0, 2, 2, device=d),
                                                         out=torch.empty(0, 2, 2, device=d)),
    "ormqr": lambda d: torch.ormqr(torch.randn(0, 3, 3, device=d), torch.randn(0, 3, device=d),
                                   torch.randn(0, 3, 2, device=d), out=torch.empty(0, 3, 2, device=d)),
    "triangular_solve": lambda d: torch.triangular_solve(
        torch.randn(0, 3, 2, device=d), torch.randn(0, 3, 3, device=d),
        out=(torch.empty(0, 3, 2, device=d), torch.empty(0, 3, 3, device=d))),
    "linalg_solve": lambda d: torch.linalg.solve(torch.randn(0, 3, 3, device=d), torch.randn(0, 3, 2, device=d),
                                                 out=torch.empty(0, 3, 2, device=d)),
}


@pytest.mark.parametrize("name", list(EMPTY_OUT))
def test_an_empty_out_tensor_is_laid_out_as_eager_lays_it_out(name):
    # LAPACK kernels restride an empty out= tensor of the right shape to
    # column-major; mgpu kept the given strides (found by test_ops' test_out).
    strides = {}
    for device in ("cpu", "mgpu"):
        out = EMPTY_OUT[name](device)
        outs = out if isinstance(out, tuple) else (out,)
        torch_mgpu.synchronize()
        strides[device] = [o.stride() for o in outs]
    assert strides["mgpu"] == strides["cpu"]
