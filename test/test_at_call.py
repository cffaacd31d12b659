"""Running at the call (engine/at_call.h): a trace's ops run as eager runs
them, from their calls, with every guarantee of the lazy path; and the
measured choice between that and the lazy way ("auto")."""
import os

import pytest
import torch
import torch.nn.functional as F

import torch_mgpu
from torch_mgpu import _C
from conftest import run_in_threads


@pytest.fixture
def at_call():
    """Sets the at-call mode for a test, and the one before back after it."""
    saved = _C._at_call()

    def use(mode):
        torch_mgpu.synchronize()
        torch_mgpu.configure(at_call=mode)

    yield use
    torch_mgpu.synchronize()
    _C._set_at_call(saved)


def ran_at_call(fn):
    """Runs fn(); returns its result and how many ops ran at their call,
    checking that none was left pending."""
    before = torch_mgpu.stats()["at_call_ops"]
    out = fn()
    assert torch_mgpu.pending_ops() == 0
    return out, torch_mgpu.stats()["at_call_ops"] - before


def test_ops_run_at_their_call_with_eager_values(at_call):
    at_call("on")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 48, generator=g), torch.randn(48, 16, generator=g)
    ma, mb = a.to("mgpu"), b.to("mgpu")
    got, n = ran_at_call(lambda: torch.tanh(ma @ mb).mul(0.5).add(0.1).relu().sum(0))
    assert n == 6  # mm, tanh, mul, add, relu, sum
    assert torch.equal(got.cpu(), torch.tanh(a @ b).mul(0.5).add(0.1).relu().sum(0))


def test_in_place_writes_through_views_and_out_at_the_call(at_call):
    at_call("on")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g)
    mx = x.to("mgpu")
    _, n = ran_at_call(lambda: mx[:, 2:5].mul_(3.0))
    assert n == 1
    x[:, 2:5].mul_(3.0)
    assert torch.equal(mx.cpu(), x)
    t = mx.t()
    t[1].add_(1.5)  # a view of a view: the base changes
    x.t()[1].add_(1.5)
    assert torch.equal(mx.cpu(), x)
    # out=, resized as eager resizes it
    out_m, out = torch.empty(0, device="mgpu"), torch.empty(0)
    torch.add(mx, 2.0, out=out_m)
    torch.add(x, 2.0, out=out)
    assert out_m.shape == out.shape and torch.equal(out_m.cpu(), out)
    assert out_m.stride() == out.stride()


def test_in_place_writes_at_the_call_copy_only_bytes_something_else_holds(at_call):
    """An in-place op at the call writes into its storage's own bytes where
    nothing else holds them, as eager does (stats()["write_copies"] stays),
    and into a copy where something does (a pending node that reads them),
    which keeps reading the value it was recorded with."""
    at_call("on")
    g = torch.Generator().manual_seed(21)
    x = torch.randn(256, generator=g)
    t, mt = x * 1.5, x.to("mgpu") * 1.5
    before = torch_mgpu.stats()["write_copies"]
    for _ in range(5):
        t.add_(0.25).mul_(0.5)
        mt.add_(0.25).mul_(0.5)
    assert torch_mgpu.stats()["write_copies"] == before
    assert torch.equal(mt.cpu(), t)
    _C._set_at_call("off")  # recorded: the node reads t's bytes when it runs
    pending = mt * 2.0
    _C._set_at_call("on")
    assert torch_mgpu.pending_ops() == 1
    want_pending = t * 2.0
    mt.add_(1.0)
    t.add_(1.0)
    assert torch_mgpu.stats()["write_copies"] == before + 1
    assert torch.equal(pending.cpu(), want_pending)
    assert torch.equal(mt.cpu(), t)


def test_in_place_ops_at_the_call_return_their_argument_and_take_no_reference(at_call):
    """The commonest ops reach mgpu with their tensors borrowed; at the call
    an in-place one returns its argument, the same Python object, and leaves
    no reference behind (nor takes one away)."""
    import sys
    import weakref
    at_call("on")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, generator=g)
    mx = x.to("mgpu")
    before = sys.getrefcount(mx)
    for _ in range(20):
        r, n = ran_at_call(lambda: mx.add_(1.25))
        assert r is mx and n == 1
        del r
        mx.mul_(mx).clamp_(max=4.0)  # the same tensor twice
        x.add_(1.25)
        x.mul_(x).clamp_(max=4.0)
    with pytest.raises(RuntimeError, match="must match the size"):  # a kernel that raises: the same count
        mx.add_(torch.ones(3, device="mgpu"))
    assert sys.getrefcount(mx) == before
    assert torch.equal(mx.cpu(), x)
    gone = weakref.ref(mx)
    del mx
    assert gone() is None


def test_copies_between_mgpu_tensors_and_casts_run_at_the_call(at_call):
    at_call("on")
    x = torch.randn(5, 7)
    mx = x.to("mgpu")
    assert torch_mgpu.pending_ops() == 0
    got, n = ran_at_call(lambda: (mx.t().contiguous(), mx.to(torch.float64), mx.clone()))
    assert n == 3
    for g, e in zip(got, (x.t().contiguous(), x.to(torch.float64), x.clone())):
        assert g.dtype == e.dtype and g.stride() == e.stride() and torch.equal(g.cpu(), e)


def test_cpu_autocast_leaves_mgpu_ops_alone_at_the_call(at_call):
    x = torch.randn(8, 8)
    for mode in ("off", "on"):
        at_call(mode)
        mx = x.to("mgpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mx @ mx  # CPU autocast is not mgpu's: float32, as eager on another device
        assert y.dtype == torch.float32 and torch.equal(y.cpu(), x @ x), mode


def test_errors_are_eagers_at_the_call_and_tensors_stay_usable(at_call):
    at_call("on")
    x = torch.randn(4, 5)
    mx = x.to("mgpu")
    with pytest.raises(RuntimeError) as eager:
        x @ x
    with pytest.raises(RuntimeError) as mgpu:
        mx @ mx
    assert str(mgpu.value) == str(eager.value)
    with pytest.raises(RuntimeError) as eager:
        x.add_(torch.randn(3))
    with pytest.raises(RuntimeError) as mgpu:
        mx.add_(torch.randn(3).to("mgpu"))
    assert str(mgpu.value) == str(eager.value)
    assert torch.equal(mx.cpu(), x)
    assert torch.equal((mx * 2).cpu(), x * 2)


def test_random_ops_draw_the_same_numbers_at_the_call_as_lazily(at_call):
    def draw():
        torch.manual_seed(1234)
        x = torch.ones(64, 32, device="mgpu")
        a = torch.randn(5, 7, device="mgpu")
        b = torch.rand(3, device="mgpu", generator=torch.Generator("mgpu").manual_seed(9))
        c = F.dropout(x, 0.5, training=True)  # draws from the default generator, no Generator argument
        d = torch.empty(10, device="mgpu").uniform_(-1, 1)
        e = torch.bernoulli(torch.full((20,), 0.3, device="mgpu"))
        return [t.cpu() for t in (a, b, c, d, e)]

    at_call("off")
    lazy = draw()
    at_call("on")
    before = torch_mgpu.stats()["at_call_ops"]
    now = draw()
    assert torch_mgpu.stats()["at_call_ops"] - before >= 5
    for lz, nw in zip(lazy, now):
        assert torch.equal(lz, nw)
    assert 0.3 < (lazy[2] == 0).float().mean() < 0.7  # dropout dropped about half


def test_autograd_at_the_call_gives_eagers_gradients(at_call):
    at_call("on")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 8, generator=g, requires_grad=True)
    x = torch.randn(4, 16, generator=g)
    mw = w.detach().to("mgpu").requires_grad_()
    _, n = ran_at_call(lambda: torch.tanh(x.to("mgpu") @ mw).pow(2).sum().backward())
    assert n >= 5  # the backward's ops too
    torch.tanh(x @ w).pow(2).sum().backward()
    assert torch.equal(mw.grad.cpu(), w.grad)


def test_a_foreach_optimizer_step_at_the_call_is_eagers(at_call):
    at_call("on")
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))
    mmodel = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3)).to("mgpu")
    mmodel.load_state_dict({k: v.to("mgpu") for k, v in model.state_dict().items()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    mopt = torch.optim.Adam(mmodel.parameters(), lr=1e-2, foreach=True)
    x, y = torch.randn(10, 12), torch.randn(10, 3)
    mx, my = x.to("mgpu"), y.to("mgpu")
    for _ in range(3):
        for m, o, a, b in ((model, opt, x, y), (mmodel, mopt, mx, my)):
            o.zero_grad()
            F.mse_loss(m(a), b).backward()
            o.step()
    assert torch_mgpu.pending_ops() == 0
    for p, mp in zip(model.parameters(), mmodel.parameters()):
        assert torch.equal(mp.cpu(), p)


def test_threads_run_their_ops_at_the_call(at_call):
    at_call("on")
    xs = [torch.randn(20, 20) for _ in range(4)]
    results = [None] * 4

    def work(i):
        m = xs[i].to("mgpu")
        for _ in range(20):
            m = torch.tanh(m @ m.t() * 0.01 + i)
        results[i] = m.cpu()
    run_in_threads(work, 4)
    for i, x in enumerate(xs):
        ref = x
        for _ in range(20):
            ref = torch.tanh(ref @ ref.t() * 0.01 + i)
        assert torch.equal(results[i], ref)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_runs_ops_at_the_call(at_call):
    at_call("on")
    x = torch.randn(8, 8)
    mx = x.to("mgpu")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        code = 3
        try:
            before = torch_mgpu.stats()["at_call_ops"]
            y = torch.relu(mx @ mx + 1)
            ok = torch_mgpu.pending_ops() == 0 and torch_mgpu.stats()["at_call_ops"] > before
            code = 0 if ok and torch.equal(y.cpu(), torch.relu(x @ x + 1)) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_off_records_every_op(at_call):
    at_call("off")
    before = torch_mgpu.stats()["at_call_ops"]
    m = torch.randn(5, 5).to("mgpu")
    y = (m @ m).relu()
    assert torch_mgpu.pending_ops() == 2
    y.cpu()
    assert torch_mgpu.stats()["at_call_ops"] == before


def test_a_bad_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="at_call must be 'auto', 'on' or 'off'"):
        torch_mgpu.configure(at_call="sometimes")


def test_auto_tries_each_way_and_keeps_the_one_its_medians_say(at_call):
    """The choice follows what was measured (whatever the machine's load
    made of it): the fastest way's median beats the lazy way's by the
    margin, else the lazy way. Values are eager's whichever way ran (within
    tier 1's rounding where the lazy way runs compiled code)."""
    at_call("auto")
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(24, 24, generator=g), torch.randn(6, 24, generator=g)
    mw = w.to("mgpu")
    torch_mgpu.synchronize()
    ways = set()
    # Runs enough for tier 1's trial of the lazy way's graph (`+ i` is an
    # integer constant compiled in: its code never fits a later run, and the
    # trial gives up after its runs) before the lazy way is timed.
    for i in range(64):
        before = torch_mgpu.stats()["at_call_ops"]
        mx = x.to("mgpu")  # an upload in the loop: the same ops counted either way
        got = torch.tanh(mx @ mw + i).sum().item()  # item() reads: the trace ends
        ways.add(torch_mgpu.stats()["at_call_ops"] > before)
        assert got == pytest.approx(torch.tanh(x @ w + i).sum().item(), rel=1e-5)  # tier 1 rounds otherwise
        # No trial runs while tier 1 compiles the lazy way's graph.
        assert torch_mgpu.wait_for_compiles(300)
    assert ways == {True, False}  # the trial ran both
    (trace,) = [t for t in torch_mgpu.trace_choices() if t["runs"] == 64]
    assert trace["state"] == "chosen", (trace, torch_mgpu.stats())
    lazy, *at_the_call = trace["medians_s"]
    assert len(at_the_call) == 2 and all(m > 0 for m in trace["medians_s"])
    best = min(range(2), key=lambda k: at_the_call[k])
    expect = ("at the call", "at the call, one thread")[best] if at_the_call[best] * 1.02 < lazy else "lazy"
    assert trace["way"] == expect, trace


def test_each_read_ends_a_trace(at_call):
    at_call("auto")
    m = torch.randn(4, 4).to("mgpu")
    torch_mgpu.synchronize()
    for _ in range(3):
        a = (m + 1).relu()
        a.cpu()  # a copy to the host
        b = (m * 2).tanh().sin()
        b.sum().item()  # item
        c = m.exp()
        torch_mgpu.synchronize()
    ops = sorted(t["ops"] for t in torch_mgpu.trace_choices() if t["runs"] == 3)
    assert ops == [1, 2, 5]  # exp; add, relu; mul, tanh, sin, sum, item


def test_the_same_ops_over_other_sizes_are_another_trace(at_call):
    """A trace is its ops and the sizes they work on: a program that runs the
    same ops over small and large inputs gets a choice for each."""
    at_call("auto")
    g = torch.Generator().manual_seed(5)
    small, large = torch.randn(8, 8, generator=g).to("mgpu"), torch.randn(40, 40, generator=g).to("mgpu")
    torch_mgpu.synchronize()
    known = {t["trace"] for t in torch_mgpu.trace_choices()}
    for _ in range(3):
        for m in (small, large):
            (m @ m).relu().sum().item()
    new = [t for t in torch_mgpu.trace_choices() if t["trace"] not in known and t["runs"] == 3]
    assert len(new) == 2 and new[0]["ops"] == new[1]["ops"], new


@pytest.mark.parametrize("mode", ["off", "on"])
def test_out_and_in_place_calls_of_the_optimizers_and_composites_reach_unboxed_kernels(at_call, mode):
    """abs (empty + abs.out), mul's out=, and Adam's lerp_, addcmul_ and
    addcdiv_ have unboxed kernels that borrow their tensors; an out= call
    returns its out= tensor, resized as eager resizes it, recorded or at the
    call."""
    for name in ("aten::abs.out", "aten::mul.out", "aten::lerp_.Scalar", "aten::addcmul_", "aten::addcdiv_"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1"), name
    at_call(mode)
    g = torch.Generator().manual_seed(6)
    a, b, c = (torch.randn(5, 7, generator=g) for _ in range(3))
    ma, mb, mc = a.to("mgpu"), b.to("mgpu"), c.to("mgpu")
    out_m, out = torch.empty(3, device="mgpu"), torch.empty(3)
    assert torch.abs(ma, out=out_m) is out_m
    torch.abs(a, out=out)
    assert out_m.shape == out.shape and torch.equal(out_m.cpu(), out)
    assert torch.mul(ma, mb, out=out_m) is out_m
    assert torch.equal(out_m.cpu(), torch.mul(a, b))
    assert ma.lerp_(mb, 0.3) is ma and ma.addcmul_(mb, mc, value=0.5) is ma and ma.addcdiv_(mb, mc.abs() + 1) is ma
    a.lerp_(b, 0.3).addcmul_(b, c, value=0.5).addcdiv_(b, c.abs() + 1)
    assert torch.equal(ma.cpu(), a)


@torch.library.custom_op("mgpu_test::one_tensor", mutates_args=(), device_types="cpu")
def _one_tensor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tensor(a is b)


@_one_tensor.register_fake
def _(a, b):
    return torch.empty((), dtype=torch.bool)


def test_a_value_read_again_at_the_call_is_the_same_and_an_equal_view_is_another_tensor(at_call):
    # An op at its call reads a value as the CPU tensor it was made as, and
    # reads it again so: values and in-place writes stay eager's, and two
    # mgpu tensors of one geometry (x and an equal view) are two tensors to
    # the kernel, as in eager (an op whose CPU kernel tells whether its two
    # arguments are one tensor).
    at_call("on")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 7, generator=g)
    x[1, 2] = float("nan")
    mx = x.to("mgpu")
    y, my = x * 1.5, mx * 1.5
    torch.testing.assert_close(my.cpu(), y, rtol=0, atol=0, equal_nan=True)
    for step in range(3):
        y, my = y + x * (step + 1), my + mx * (step + 1)  # each result read as it was made
        torch.testing.assert_close(my.cpu(), y, rtol=0, atol=0, equal_nan=True)
    same = my.view(35).view(5, 7)
    assert bool(_one_tensor(my, same).cpu()) is bool(_one_tensor(y, y.view(35).view(5, 7))) is False
    assert bool(_one_tensor(my, my).cpu()) is bool(_one_tensor(y, y)) is True
    my.add_(1.0)  # written in place: read again with its new bytes
    y.add_(1.0)
    torch.testing.assert_close((my * 2).cpu(), y * 2, rtol=0, atol=0, equal_nan=True)
    with torch.inference_mode():
        z, mz = y * 3, my * 3
    torch.testing.assert_close((mz + 1).cpu(), z + 1, rtol=0, atol=0, equal_nan=True)


_lib = torch.library.Library("mgpu_test", "FRAGMENT")
_lib.define("rebinds(Tensor a) -> Tensor")
# A kernel that breaks its op's contract: it gives the tensor it reads other
# bytes (set_). The program's value is not the kernel's to change: a later
# op reads it as it was, at the call as lazily.
_lib.impl("rebinds", lambda a: (a * 2, a.set_(torch.full_like(a, -7.0)))[0], "CPU")
_lib.impl("rebinds", lambda a: torch.empty_like(a), "Meta")


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_kernel_that_rebinds_the_tensor_it_reads_leaves_the_value_as_it_was(at_call, mode):
    at_call(mode)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 6, generator=g)
    my = x.to("mgpu") * 1.5  # at the call: my's value is kept with the CPU tensor it was made as
    r = torch.ops.mgpu_test.rebinds(my)
    torch.testing.assert_close(r.cpu(), x * 1.5 * 2, rtol=0, atol=0)
    torch.testing.assert_close((my + 1).cpu(), x * 1.5 + 1, rtol=0, atol=0)
