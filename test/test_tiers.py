"""Tier 1 of the lazy path: a graph that syncs again and again is compiled
with inductor in the background, and later syncs of it run the compiled
code when it measures faster than running node by node."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

import torch_mgpu
from torch_mgpu import _tiers
from conftest import run_hot


@pytest.fixture
def tiered():
    saved, hits = torch_mgpu.async_ops(), torch_mgpu._C._tier_compile_hits()
    # Compiles an earlier test queued (its graphs got hot with tier 1 on, as
    # it is by default) finish first: the counts a test takes are its own.
    assert torch_mgpu.wait_for_compiles(300)
    torch_mgpu.set_async_ops(0)  # one graph per sync: the same graph every step
    torch_mgpu.configure(compile=2)
    yield
    torch_mgpu.wait_for_compiles(120)
    torch_mgpu.configure(compile=hits)
    torch_mgpu.set_async_ops(saved)


def tier1_stats():
    return {k: v for k, v in torch_mgpu.stats().items() if k.startswith("tier1_")}


def step(x, w, b):
    # A product, pointwise work, a reduction, an in-place write into an
    # input and an out= call: every kind of node a compiled graph replays.
    y = torch.tanh(x @ w) * 2 + b
    z = y.sum(1, keepdim=True)
    x.add_(z, alpha=1e-3)
    out = torch.empty_like(y)
    torch.mul(y, z, out=out)
    return torch.relu(out - 1)


def unary_chain(op, steps, factor):
    """x -> op(x * factor), `steps` times: 2 * steps tiny ops, node by node
    that many calls and their overheads, in inductor's code one loop. Tests
    that need a graph of their own (graphs are remembered by structure, per
    process) take another op or length."""
    def chain(x):
        for _ in range(steps):
            x = op(x * factor)
        return x
    return chain


long_chain = unary_chain(torch.tanh, 100, 1.0001)


def test_a_hot_graph_is_compiled_and_runs_with_eager_results(tiered):
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(64, 32, generator=g), torch.randn(32, 32, generator=g), torch.randn(32, generator=g))
    xm, wm, bm = x.to("mgpu"), w.to("mgpu"), b.to("mgpu")
    before = tier1_stats()
    tiers = []
    for k in range(7):
        want = step(x, w, b)
        got = step(xm, wm, bm).cpu()
        # Inductor's kernels round differently from eager's: float tolerance.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(xm.cpu(), x, rtol=1e-4, atol=1e-4)  # the in-place write, in either tier
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    after = tier1_stats()
    assert after["tier1_hot_graphs"] - before["tier1_hot_graphs"] == 1
    assert after["tier1_compiled"] - before["tier1_compiled"] == 1
    assert after["tier1_compile_us"] > before["tier1_compile_us"]
    # Hot after two runs, compiled before the third: then on trial in tier 1.
    assert tiers[:2] == [0, 0] and tiers[2] == 1
    assert after["tier1_runs"] > before["tier1_runs"]
    assert after["tier1_call_us"] > before["tier1_call_us"]
    assert after["tier1_fallbacks"] == before["tier1_fallbacks"]


def test_compiled_code_is_kept_where_it_is_faster(tiered):
    x = torch.randn(64)
    xm = x.to("mgpu")
    want = long_chain(x)
    plans = []
    for k in range(13):
        torch.testing.assert_close(long_chain(xm).cpu(), want, rtol=1e-4, atol=1e-5)
        plans.append(torch_mgpu.last_plan())
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    # Its trial: a cold run, then three timed ones in turns with three of
    # tier 0 (measured in the same stretch of the machine's load, and after
    # tier 0's plan was refined); then it stays in tier 1.
    assert [p.tier for p in plans[2:9]] == [1, 1, 0, 1, 0, 1, 0], torch_mgpu._C._tier_last_error()
    assert [p.tier for p in plans[9:]] == [1] * 4, torch_mgpu._C._tier_last_error()
    assert "tier 1: compiled 200 ops (mul, tanh)" in str(plans[-1])
    assert "kept after it measured whole" in plans[-1].compiled and "tier 0" in plans[-1].compiled


def test_tier_0_runs_on_other_lanes_are_no_samples_of_a_trial(tiered):
    # On trial, the graph runs on stream lanes for a while (CPU lanes under
    # the stream-order sanitizer): its code, compiled for host lanes, does
    # not fit them, so tier 0 runs it there, and those runs count for the
    # stream lanes' own entry, not as the trial's tier-0 samples: back on
    # the lanes it was compiled for, the turns go on where they stopped.
    cos_chain = unary_chain(torch.cos, 150, 0.9999)

    x = torch.randn(64)
    xm = x.to("mgpu")
    want = cos_chain(x)
    before = torch_mgpu.configuration()
    tiers = []
    try:
        for k in range(14):
            if k == 3:
                torch_mgpu.configure(devices=["cpu", "cpu"], lanes_per_device=1)
                torch_mgpu._C._stream_sanitizer_start()
            if k == 6:
                assert torch_mgpu._C._stream_sanitizer_stop() == []
                torch_mgpu.configure(**before)
            torch.testing.assert_close(cos_chain(xm).cpu(), want, rtol=1e-4, atol=1e-5)
            tiers.append(torch_mgpu.last_plan().tier)
            if k == 1:
                assert torch_mgpu.wait_for_compiles(300)
    finally:
        torch_mgpu._C._stream_sanitizer_stop()
        torch_mgpu.configure(**before)
    # Cold and first timed compiled runs, three runs on the stream lanes,
    # then tier 0's first turn and the rest of the trial's turns.
    assert tiers[:12] == [0, 0, 1, 0, 0, 0, 1, 0, 1, 0, 1, 0], tiers
    assert tiers[12:] in ([1, 1], [0, 0]), tiers  # kept, or not


def test_a_compile_on_the_compile_thread_undoes_no_draw_of_the_program(tiered, monkeypatch):
    # Inductor and AOT autograd read the default generator's state at the
    # start of a compile and set it back at its end (preserve_rng_state).
    # The compile thread runs beside the program: a draw the program made
    # meanwhile was undone, and its numbers came again.
    from torch._dynamo import utils as dynamo_utils
    compiling, drawn = threading.Event(), threading.Event()
    real = _tiers.compile_request

    def drawn_during(req):
        with dynamo_utils.preserve_rng_state():  # as compile_fx takes it
            compiling.set()
            assert drawn.wait(120)
            return real(req)

    monkeypatch.setattr(_tiers, "compile_request", drawn_during)
    chain = unary_chain(torch.cos, 23, 0.9999)
    xm = torch.randn(64).to("mgpu")
    torch.manual_seed(3)
    want = torch.rand(20)
    torch.manual_seed(3)
    try:
        for _ in range(3):
            chain(xm).cpu()
        assert compiling.wait(120)
        first = torch.rand(10)  # while the graph compiles
    finally:
        drawn.set()
    assert torch_mgpu.wait_for_compiles(300)
    assert torch.equal(torch.cat([first, torch.rand(10)]), want)


def test_kept_code_that_slows_down_goes_through_a_second_trial(tiered, monkeypatch):
    # Kept code is watched: when its recent runs take twice what its first
    # ones took (here: it starts sleeping, as on a machine that got busy),
    # the code goes through a second trial, in turns with tier 0.
    delay = [0.0]
    real = _tiers.compile_request

    def slowing(req):
        fn, dtypes, description, lifted = real(req)

        def call(tensors):
            time.sleep(delay[0])
            return fn(tensors)
        return call, dtypes, description, lifted

    monkeypatch.setattr(_tiers, "compile_request", slowing)
    sin_chain = unary_chain(torch.sin, 100, 1.0001)

    x = torch.randn(64)
    xm = x.to("mgpu")
    want = sin_chain(x)
    tiers = []
    torch_mgpu._C._set_tier_trial(False)  # kept at once, whatever the machine's load
    try:
        for k in range(40):
            if k == 3:
                torch_mgpu._C._set_tier_trial(True)  # watched from here: 8 runs set its measure
            if k == 14:
                delay[0] = 0.02
            torch.testing.assert_close(sin_chain(xm).cpu(), want, rtol=1e-4, atol=1e-5)
            tiers.append(torch_mgpu.last_plan().tier)
            if k == 1:
                assert torch_mgpu.wait_for_compiles(300)
    finally:
        torch_mgpu._C._set_tier_trial(True)
    assert tiers[:14] == [0, 0] + [1] * 12, tiers
    # Slow runs until the median of the last 8 doubles, then the second
    # trial: 3 slow runs in turns with 3 of tier 0 (none of tier 0's runs
    # of before counts); dropped, tier 0 from then on.
    slow = tiers[14:]
    first0 = slow.index(0)
    assert 2 <= first0 <= 9 and slow[first0 - 1:first0 + 5] == [1, 0, 1, 0, 1, 0], tiers
    assert set(slow[first0 + 5:]) == {0}, tiers
    assert "ran no faster than tier 0" in torch_mgpu._C._tier_last_error()


def test_floating_constants_are_inputs_of_the_compiled_code(tiered, no_trial):
    # A learning rate that changes every step keeps the graph's structure
    # (the plan cache's hash sees floats by class): compiled code takes it
    # as an input, and every step runs in tier 1 with its own value.
    x = torch.randn(8, 8)
    xm = x.to("mgpu")

    def f(t, lr):
        return torch.sigmoid(t * lr).sum(0) + lr

    for lr in (0.5, 0.4):  # it changes between the runs that make the graph hot
        f(xm, lr).cpu()
    assert torch_mgpu.wait_for_compiles(300)
    tiers = []
    for lr in (0.5, 0.25, 0.125, 3.0):
        torch.testing.assert_close(f(xm, lr).cpu(), f(x, lr), rtol=1e-4, atol=1e-5)
        tiers.append(torch_mgpu.last_plan().tier)
    assert tiers == [1, 1, 1, 1]
    assert "2 constant(s) as inputs" in torch_mgpu.last_plan().compiled


def test_constants_compiled_in_must_match(tiered, no_trial):
    # clamp's bound is a Scalar argument: it stays a constant of the compiled
    # code, which then runs only for that value.
    x = torch.randn(8, 8)
    xm = x.to("mgpu")

    def f(t, lo):
        return torch.clamp(torch.sin(t), min=lo) * 2

    for lo in (-0.5, -0.4):  # changed: it would be an input, were it a Tensor argument
        f(xm, lo).cpu()
    assert torch_mgpu.wait_for_compiles(300)
    tiers = []
    for lo in (-0.4, 0.25, -0.4):
        torch.testing.assert_close(f(xm, lo).cpu(), f(x, lo), rtol=1e-4, atol=1e-5)
        tiers.append(torch_mgpu.last_plan().tier)
    assert tiers == [1, 0, 1]


def test_constants_that_did_not_change_are_compiled_in(tiered, no_trial):
    x = torch.randn(8, 8)
    xm = x.to("mgpu")

    def f(t, lr):
        return torch.tanh(t * lr).sum(1) + 2.5

    for _ in range(2):
        f(xm, 0.5).cpu()
    assert torch_mgpu.wait_for_compiles(300)
    tiers = []
    for lr in (0.5, 0.25):
        torch.testing.assert_close(f(xm, lr).cpu(), f(x, lr), rtol=1e-4, atol=1e-5)
        tiers.append(torch_mgpu.last_plan().tier)
    assert tiers == [1, 0]
    assert "as inputs" not in torch_mgpu.last_plan().compiled


def test_a_backward_with_gradients_it_does_not_need_compiles(tiered, no_trial):
    # convolution_backward with no bias and an input that needs no gradient
    # returns (None, grad_weight, None): the compiled replay keeps each
    # return in its place.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 8, 8, generator=g)
    w = torch.randn(4, 3, 3, 3, generator=g)
    wm = w.to("mgpu").requires_grad_()
    xm = x.to("mgpu")
    want = torch.autograd.grad(torch.nn.functional.conv2d(x, w.requires_grad_()).square().sum(), w)[0]
    tiers = []
    for k in range(4):
        (got,) = torch.autograd.grad(torch.nn.functional.conv2d(xm, wm).square().sum(), wm)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()


def make_training(device, foreach, optimizer=torch.optim.Adam, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    opt = optimizer(model.parameters(), lr=1e-2, foreach=foreach, **options)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)


def train_step(model, opt, sched, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()  # the step's one sync


def train_side_by_side(ref, got, x, y, xm, ym, steps):
    """`steps` training steps of `ref` (CPU) and `got` (mgpu), each loss
    against eager's, the compiles waited for after the third (the first
    step's graph is another: it makes the optimizer's state, or has no
    update before it); the parameters against eager's at the end. Returns
    the tier of each step."""
    tiers = []
    for k in range(steps):
        want = train_step(*ref, x, y)
        assert abs(train_step(*got, xm, ym) - want) < 1e-4
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 2:
            assert torch_mgpu.wait_for_compiles(300)
    for a, b in zip(ref[0].parameters(), got[0].parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)
    return tiers


def test_background_flights_run_compiled_code(tiered, no_trial):
    # With background execution a step is cut into flights every async_ops
    # ops, the same cuts every step: each flight's graph gets hot and runs
    # compiled on the background worker, as the sync's own graph does.
    torch_mgpu.set_async_ops(64)
    x = torch.randn(64)
    xm = x.to("mgpu")

    def f(t):
        out = long_chain(t)  # 200 ops: three flights and the sync's own graph
        t.mul_(0.999)  # an in-place write, in the sync's graph
        return out

    runs, flights = [], []
    for k in range(8):
        s0 = torch_mgpu.stats()
        want = f(x)
        torch.testing.assert_close(f(xm).cpu(), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xm.cpu(), x)
        s1 = torch_mgpu.stats()
        runs.append(s1["tier1_runs"] - s0["tier1_runs"])
        flights.append(s1["background_flushes"] - s0["background_flushes"])
        if k in (1, 2):  # (a graph of the first step may differ: its hits start one step later)
            assert torch_mgpu.wait_for_compiles(300)
    assert flights == [3] * 8, flights
    # The first step runs tier 0. Its graphs are hot after it and compile
    # in the background: by the second step any number of those compiles
    # may be done (inductor's cache warm from an earlier compile of the same
    # code, a busy machine), so that step runs 0 to 4 of them compiled.
    assert runs[0] == 0 and 0 <= runs[1] <= 4 and runs[4:] == [4] * 4, (runs, torch_mgpu._C._tier_last_error())


@pytest.fixture
def no_trial():
    torch_mgpu._C._set_tier_trial(False)
    yield
    torch_mgpu._C._set_tier_trial(True)


@pytest.mark.parametrize("foreach", [False, None])
def test_a_training_loop_with_adam_and_a_cosine_schedule_stays_in_tier_1(tiered, no_trial, foreach):
    # Adam's step sizes and bias corrections and the schedule's learning
    # rate change every step: they are inputs of the one compiled graph.
    # foreach=None is Adam's default, the foreach kernels on mgpu (their
    # lists of scalars become one constant per tensor).
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
    ref, got = make_training("cpu", False), make_training("mgpu", foreach)
    if foreach is None:
        assert _default_to_fused_or_foreach(list(got[0].parameters()), False, False)[1]
    xm, ym = x.to("mgpu"), y.to("mgpu")
    before = tier1_stats()
    tiers = train_side_by_side(ref, got, x, y, xm, ym, 10)
    assert tiers[:3] == [0, 0, 0] and tiers[3:] == [1] * 7, torch_mgpu._C._tier_last_error()
    after = tier1_stats()
    assert after["tier1_compiled"] - before["tier1_compiled"] == 1  # no compile per step
    assert "constant(s) as inputs" in torch_mgpu.last_plan().compiled


@pytest.mark.parametrize("optimizer,options", [(torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9}),
                                               (torch.optim.Adam, {"amsgrad": True, "weight_decay": 1e-3})])
def test_default_foreach_optimizers_with_a_schedule_run_one_compiled_graph(tiered, no_trial, optimizer, options):
    # The optimizers' defaults on mgpu (foreach kernels, their lists of
    # scalars) with a schedule: one compile, every step after warm-up in
    # tier 1.
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
    ref, got = make_training("cpu", False, optimizer, **options), make_training("mgpu", None, optimizer, **options)
    assert _default_to_fused_or_foreach(list(got[0].parameters()), False, False)[1]
    before = tier1_stats()
    tiers = train_side_by_side(ref, got, x, y, x.to("mgpu"), y.to("mgpu"), 8)
    assert tiers[3:] == [1] * 5, (tiers, torch_mgpu._C._tier_last_error())
    assert tier1_stats()["tier1_compiled"] - before["tier1_compiled"] == 1


def test_an_elementwise_graph_after_a_product_under_another_precision_reaches_tier_1(tiered, no_trial):
    # Elementwise ops take the pending ops' matmul precision (they read
    # none): here "medium", left over from a product before the program
    # went back to "highest". Tier 1 refused every graph called under
    # non-default settings, for good: these ops never read that one.
    a = torch.randn(64, 64)
    am = a.to("mgpu")
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        (am @ am).cpu()
        torch.set_float32_matmul_precision("highest")
        tiers = []
        for k in range(4):
            torch.testing.assert_close(((am * 1.5).tanh() + am).cpu(), (a * 1.5).tanh() + a, rtol=1e-5, atol=1e-6)
            tiers.append(torch_mgpu.last_plan().tier)
            if k == 1:
                assert torch_mgpu.wait_for_compiles(300)
    finally:
        torch.set_float32_matmul_precision(prev)
    assert tiers == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()


def make_attention_training(device):
    torch.manual_seed(3)
    model = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).to(device)
    # SGD, not Adam: the key projection's bias has a gradient of zero but
    # for rounding (softmax ignores a shift of every score of a query), and
    # Adam scales that noise up to whole steps of the learning rate.
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=False)
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)


def test_attention_without_dropout_reaches_tier_1(tiered, no_trial):
    # scaled_dot_product_attention's CPU kernel is tagged as seeded (for its
    # dropout): with dropout_p 0 it draws nothing, so its node has no seed
    # and a transformer's step compiles (a seeded node keeps its graph in
    # tier 0).
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)
    ref, got = make_attention_training("cpu"), make_attention_training("mgpu")
    tiers = train_side_by_side(ref, got, x, y, x.to("mgpu"), y.to("mgpu"), 6)
    assert tiers[3:] == [1] * 3, (tiers, torch_mgpu._C._tier_last_error())
    assert "attention" in torch_mgpu.last_plan().compiled


@pytest.mark.parametrize("causal", [False, True])
def test_attention_and_its_gradient_compile_as_the_op_not_its_export_form(tiered, no_trial, causal):
    # The core decompositions turn CPU flash attention into its math form,
    # whose second result is the attention weights where the op's is their
    # log-sum-exp: the backward then read the weights as the log-sum-exp
    # (gradients off by hundreds). The trace keeps the op.
    g = torch.Generator().manual_seed(5)
    q0 = torch.randn(4, 2, 8, 8, generator=g)

    def f(q):
        q = q.detach().requires_grad_()
        o = torch.nn.functional.scaled_dot_product_attention(q, q * 0.5, q + 1, is_causal=causal)
        (grad,) = torch.autograd.grad(o.square().sum(), q)
        return o.detach(), grad

    want = f(q0)
    tiers = []
    for k in range(4):
        got = f(q0.to("mgpu"))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()


@pytest.mark.parametrize("foreach", [False, None])
def test_sgd_with_a_schedule_stays_in_tier_1(tiered, no_trial, foreach):
    # SGD's update is p.add_(grad, alpha=-lr): a Scalar alpha that changes
    # every step, traced as add of grad * alpha so that it is an input (it
    # was compiled in, and every later step ran in tier 0).
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
    ref, got = make_training("cpu", False, torch.optim.SGD), make_training("mgpu", foreach, torch.optim.SGD)
    xm, ym = x.to("mgpu"), y.to("mgpu")
    before = tier1_stats()
    tiers = train_side_by_side(ref, got, x, y, xm, ym, 8)
    assert tiers[3:] == [1] * 5, (tiers, torch_mgpu._C._tier_last_error())
    assert tier1_stats()["tier1_compiled"] - before["tier1_compiled"] <= 1  # no compile per step (foreach=None may find False's)
    assert "constant(s) as inputs" in torch_mgpu.last_plan().compiled


def test_a_compiled_run_that_fails_runs_again_in_tier_0(tiered, monkeypatch):
    real = _tiers.compile_request

    def failing(req):
        fn, dtypes, description, lifted = real(req)

        def broken(tensors):
            fn(tensors)  # runs, then fails: nothing it computed may be kept
            raise RuntimeError("injected failure")
        return broken, dtypes, description, lifted

    monkeypatch.setattr(_tiers, "compile_request", failing)
    x = torch.randn(16, 16)
    xm = x.to("mgpu")

    def f(t):
        t.mul_(1.5)
        return torch.exp(t).sum(1)

    before = tier1_stats()
    for k in range(5):
        torch.testing.assert_close(f(xm).cpu(), f(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xm.cpu(), x)  # written once per step, in either tier
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    after = tier1_stats()
    assert after["tier1_fallbacks"] - before["tier1_fallbacks"] == 1
    assert torch_mgpu.last_plan().tier == 0
    assert "injected failure" in torch_mgpu._C._tier_last_error()


def test_a_keyboard_interrupt_in_a_compiled_run_stops_the_sync_and_keeps_the_code(tiered, no_trial, monkeypatch):
    # A SIGINT while the compiled code's Python wrapper runs on the syncing
    # thread raises KeyboardInterrupt there. It was taken for the code
    # failing: the code was dropped, tier 0 ran the graph and the program
    # went on (an LSTM double backward ignored SIGINT under load). Now the
    # sync raises it with nothing run: the values stay pending and a later
    # read computes them once; the code stays and runs the next steps.
    real = _tiers.compile_request
    interrupt = []

    def interrupted(req):
        fn, dtypes, description, lifted = real(req)

        def call(tensors):
            if interrupt:
                interrupt.clear()
                raise KeyboardInterrupt
            return fn(tensors)
        return call, dtypes, description, lifted

    monkeypatch.setattr(_tiers, "compile_request", interrupted)
    x = torch.randn(12, 10)  # a graph of its own (another test rejects f's of 16x16)
    xm = x.to("mgpu")

    def f(t):
        t.mul_(0.75)
        return torch.tanh(t).sum(1)

    for k in range(3):
        torch.testing.assert_close(f(xm).cpu(), f(x), rtol=1e-4, atol=1e-5)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert torch_mgpu.last_plan().tier == 1
    before = tier1_stats()
    interrupt.append(True)
    got = f(xm)
    with pytest.raises(KeyboardInterrupt):
        got.cpu()
    assert not interrupt
    want = f(x)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)  # computed once, now
    torch.testing.assert_close(xm.cpu(), x)  # written once
    assert torch_mgpu.last_plan().tier == 1
    torch.testing.assert_close(f(xm).cpu(), f(x), rtol=1e-4, atol=1e-5)
    assert torch_mgpu.last_plan().tier == 1
    after = tier1_stats()
    assert after["tier1_fallbacks"] == before["tier1_fallbacks"]
    assert after["tier1_compiled"] == before["tier1_compiled"]


def test_ops_that_size_a_fresh_out_tensor_compile(tiered, no_trial):
    # abs (like other functional ops whose kernel is empty + out=) is
    # recorded as abs.out into a fresh empty tensor it resizes: compiled as
    # the op writing a new tensor (the features benchmark stayed in tier 0).
    x = torch.randn(6, 5)
    xm = x.to("mgpu")
    tiers = []
    for k in range(4):
        got = (xm.t().abs() * 2 + xm.t()).cpu()
        torch.testing.assert_close(got, x.t().abs() * 2 + x.t())
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fn", [lambda t: torch.floor(t * 1.7 / 0.7), lambda t: torch.tanh(t * 1.0001) * 2 + t],
                         ids=["floor", "tanh"])
def test_compiled_low_precision_rounds_between_ops_as_eager(tiered, no_trial, dtype, fn):
    # Fused, inductor would keep each intermediate in float32 where eager
    # rounds it to the dtype: thousands of these 20,000 results differ
    # (a floor by a whole unit) unless the compiled code rounds as eager.
    x = (torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    xm = x.to("mgpu")
    want = fn(x)
    tiers = []
    for k in range(4):
        got = fn(xm).cpu()
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {x.numel()} differ in tier {torch_mgpu.last_plan().tier}"
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers[2:] == [1, 1], torch_mgpu._C._tier_last_error()


def test_an_out_tensor_resized_over_its_bytes_stays_in_tier_0(tiered):
    x = torch.randn(6)
    xm = x.to("mgpu")
    for k in range(4):
        out = torch.zeros(2, device="mgpu")  # bytes it had: resized, not replayed
        with pytest.warns(UserWarning, match="resized"):  # as eager warns
            torch.mul(xm, 2, out=out)
        torch.testing.assert_close((out + 1).cpu(), x * 2 + 1)
        assert torch_mgpu.last_plan().tier == 0
        if k == 1:
            torch_mgpu.wait_for_compiles(300)
    assert "an out= tensor resized" in torch_mgpu._C._tier_last_error()


def test_compiled_loops_take_the_cores_of_a_lane(tiered, monkeypatch):
    # Loops on more OpenMP threads than a lane's cores wait at each barrier
    # for a core the other lane (or another process) holds.
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import config as inductor_config

    seen = []
    real = compile_fx_module.compile_fx

    def spy(*args, **kwargs):
        seen.append(inductor_config.cpp.threads)
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    cores = os.cpu_count() or 1
    try:
        for lanes in (1, 2):
            torch_mgpu.configure(devices=["cpu"], lanes_per_device=lanes)
            x = torch.randn(3, 7 + lanes).to("mgpu")
            for _ in range(3):
                (x.exp() * 2).cpu()
            assert torch_mgpu.wait_for_compiles(300)
            assert seen[-1] == max(1, cores // lanes)
    finally:
        torch_mgpu.configure(**torch_mgpu._configuration_of(*before))


def test_random_graphs_stay_in_tier_0(tiered):
    before = tier1_stats()
    xm = torch.randn(32).to("mgpu")
    for _ in range(4):
        torch.manual_seed(3)
        got = (xm + torch.rand(32, device="mgpu")).cpu()
        torch.manual_seed(3)
        assert torch.equal(got, (xm + torch.rand(32, device="mgpu")).cpu())
    assert tier1_stats()["tier1_hot_graphs"] == before["tier1_hot_graphs"]


TIERING_DEFAULT = """
import torch, torch_mgpu
print(torch_mgpu._C._tier_compile_hits(), torch_mgpu._tiers._thread is not None and torch_mgpu._tiers._thread.is_alive())
"""


@pytest.mark.parametrize("value,hits,thread", [(None, 2, True), ("on", 2, True), ("0", 0, False), ("off", 0, False),
                                               ("5", 5, True)])
def test_tiering_is_on_by_default_and_off_when_asked(value, hits, thread):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_MGPU_COMPILE"}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "1"
    if value is not None:
        env["TORCH_MGPU_COMPILE"] = value
    done = subprocess.run([sys.executable, "-c", TIERING_DEFAULT], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(hits), str(thread)]


def test_tiering_off_compiles_nothing():
    hits = torch_mgpu._C._tier_compile_hits()
    torch_mgpu.configure(compile=0)
    try:
        before = tier1_stats()
        xm = torch.randn(16).to("mgpu")
        for _ in range(4):
            (torch.cos(xm) * 3).cpu()
        assert tier1_stats() == before
        assert torch_mgpu.last_plan().tier == 0
    finally:
        torch_mgpu.configure(compile=hits)
    with pytest.raises(ValueError, match="hit count"):
        torch_mgpu.configure(compile=-1)


EXIT_AFTER_TIER_1 = """
import torch, torch_mgpu
torch_mgpu.set_async_ops(0)
torch_mgpu.configure(compile=2)
x = torch.randn(64).to("mgpu")
for _ in range(3):
    (x * 2 + 1).cpu()
assert torch_mgpu.wait_for_compiles(120)
(x * 2 + 1).cpu()
print("tier", torch_mgpu.last_plan().tier)
"""


def test_stopping_the_compile_thread_waits_for_it():
    # The compile thread waits in C++ for the next hot graph. At exit it is
    # stopped and joined before the interpreter finalizes: left to wake
    # during finalization, taking the GIL back tore it down through C++
    # frames ("terminate called without an active exception", SIGABRT, in
    # some runs of a process that had used tier 1).
    hits = torch_mgpu._C._tier_compile_hits()
    torch_mgpu.configure(compile=2)
    try:
        thread = _tiers._thread
        assert thread.is_alive()
        _tiers.stop()
        assert not thread.is_alive()
        torch_mgpu.configure(compile=2)  # starts another
        assert _tiers._thread.is_alive() and _tiers._thread is not thread
    finally:
        torch_mgpu.configure(compile=hits)


def test_a_process_that_used_tier_1_exits_cleanly():
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    done = subprocess.run([sys.executable, "-c", EXIT_AFTER_TIER_1], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tier 1" in done.stdout and "terminate" not in done.stderr


def test_torch_compile_on_another_thread_runs_while_a_graph_is_traced(tiered, monkeypatch):
    # FX tracing sets a process-wide flag: a function torch.compile compiled,
    # called while the compile thread traces, refused to run ("Detected that
    # you are using FX to symbolically trace a dynamo-optimized function").
    from torch.fx.experimental.proxy_tensor import make_fx

    f = torch.compile(lambda a: a * 2 + 1, backend="eager")
    x = torch.randn(8)
    f(x)  # compiled before the trace starts
    inside, release = threading.Event(), threading.Event()
    real = _tiers.compile_request

    def slow(req):
        def held(t):
            inside.set()
            release.wait(60)
            return t + 1
        make_fx(held)(torch.randn(2))  # FX's flag is set while this waits
        return real(req)

    monkeypatch.setattr(_tiers, "compile_request", slow)
    xm = torch.randn(16).to("mgpu")
    for _ in range(3):
        (xm * 3 - 1).cpu()
    assert inside.wait(60)
    try:
        for _ in range(3):
            torch.testing.assert_close(f(x), x * 2 + 1)
    finally:
        release.set()
    assert torch_mgpu.wait_for_compiles(120)


@pytest.fixture
def two_lanes():
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2)
    yield
    torch_mgpu.configure(**torch_mgpu._configuration_of(*before))


def towers(a, b, c, d, acc):
    # Two independent products (each worth a lane), a join, and an in-place
    # write into an input that one tower reads first.
    left = torch.tanh(a @ b) * 0.5
    right = torch.relu(c @ d) + 0.25
    acc.add_(left.sum(0))
    return left + right, right.mean()


def tower_inputs(seed, n):
    # Each test its own size: graphs are remembered by structure, per process.
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, n, generator=g) for _ in range(4)] + [torch.randn(n, generator=g)]


def test_a_graph_with_branches_runs_its_compiled_parts_on_the_lanes(tiered, no_trial, two_lanes):
    cpu = tower_inputs(0, 400)
    mg = [t.to("mgpu") for t in cpu]
    tiers = []
    for k in range(5):
        want = towers(*cpu)
        got = towers(*mg)
        for w, t in zip(want, got):
            torch.testing.assert_close(t.cpu(), w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mg[4].cpu(), cpu[4], rtol=1e-4, atol=1e-3)  # written once a step, in either tier
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers == [0, 0, 1, 1, 1], torch_mgpu._C._tier_last_error()
    plan = torch_mgpu.last_plan()
    # Kept without a trial: the parts (the last way compiled), each tower on
    # a lane of its own, the join after both.
    assert "parts on 2 lanes" in plan.compiled, plan.compiled
    text = str(plan)
    assert "cpu:0/lane0" in text and "cpu:0/lane1" in text


def test_a_trial_times_the_whole_graph_and_its_parts_and_keeps_the_faster(tiered, two_lanes):
    cpu = tower_inputs(1, 384)
    mg = [t.to("mgpu") for t in cpu]
    before = tier1_stats()
    run_hot(towers, cpu, mg, atol=1e-4, runs=14)
    after = tier1_stats()
    assert after["tier1_compiled"] - before["tier1_compiled"] == 1
    # Each way had a cold call and three timed ones, in turns with three
    # runs of tier 0: 8 tier-1 runs, then the decision (kept: measured both;
    # or back to tier 0).
    plan = torch_mgpu.last_plan()
    if plan.tier == 1:
        assert "measured whole" in plan.compiled and "parts" in plan.compiled, plan.compiled
    else:
        assert "ran no faster than tier 0" in torch_mgpu._C._tier_last_error()
    assert after["tier1_runs"] - before["tier1_runs"] >= 8


def test_a_part_that_fails_leaves_the_graph_to_tier_0(tiered, no_trial, two_lanes, monkeypatch):
    real = _tiers.compile_request

    def failing_parts(req):
        fn, dtypes, description, lifted = real(req)
        if not req.get("split"):
            return fn, dtypes, description, lifted

        def broken(tensors):
            out = fn(tensors)
            if req["lane"] == 1:  # the part on the second lane fails after it ran
                raise RuntimeError("injected failure in a part")
            return out
        return broken, dtypes, description, lifted

    monkeypatch.setattr(_tiers, "compile_request", failing_parts)
    cpu = tower_inputs(2, 392)
    mg = [t.to("mgpu") for t in cpu]
    before = tier1_stats()
    for k in range(4):
        want = towers(*cpu)
        for w, t in zip(want, towers(*mg)):
            torch.testing.assert_close(t.cpu(), w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mg[4].cpu(), cpu[4], rtol=1e-4, atol=1e-3)  # never written twice
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    after = tier1_stats()
    assert after["tier1_fallbacks"] - before["tier1_fallbacks"] == 1
    assert "injected failure in a part" in torch_mgpu._C._tier_last_error()
    assert torch_mgpu.last_plan().tier == 0


def test_parts_that_do_not_compile_leave_the_whole_graph_and_say_why(tiered, no_trial, two_lanes, monkeypatch):
    # The whole graph still runs in tier 1; the plan's description names
    # the parts' compile error (it was silent: on a GPU machine a split
    # graph ran whole and nothing said why).
    real = _tiers.compile_request

    def parts_fail(req):
        if req.get("split"):
            raise RuntimeError("injected compile error\nin a part")
        return real(req)

    monkeypatch.setattr(_tiers, "compile_request", parts_fail)
    cpu = tower_inputs(3, 376)
    assert run_hot(towers, cpu, [t.to("mgpu") for t in cpu]) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()
    compiled = torch_mgpu.last_plan().compiled
    assert " parts on " not in compiled, compiled
    assert "parts did not compile (RuntimeError: injected compile error in a part)" in compiled, compiled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_numbers_meet_half_precision_tensors_as_in_eager(tiered, no_trial, dtype):
    # Eager's CPU kernels of add, sub, pow and fmod (and remainder) round a
    # Python number to the tensor's dtype first; inductor's code keeps it
    # in float32 (difffuzz seed 3750665: x + 2.7856 in bfloat16 added
    # 2.78125 in eager). The replay passes the number rounded: equal bits.
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(257, generator=g) - 2.7).to(dtype)
    s = 2.7855918407440186

    def f(x):
        y = (x + s) * 1.5
        z = y.sub(0.3337, alpha=1.7) - 1.1113
        w = z.abs().add_(0.0123).pow(1.37)
        return w.fmod(0.3333) * 1.25, 5.1234 - z  # (a half remainder stays in tier 0: below)

    assert run_hot(f, [x], exact=True) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()


def test_a_number_recorded_for_a_tensor_argument_compiles_with_the_python_dtype(tiered, no_trial):
    # x.remainder(0.777) records remainder.Tensor with the number (a wrapped
    # number): the replay calls the overload that takes a number (it did not
    # compile at all), and an integer tensor's result is the default dtype,
    # as in eager (a float64 0-dim tensor in the number's place gives float64).
    x = torch.randint(-50, 50, (33,), generator=torch.Generator().manual_seed(4))

    def f(x):
        return (x.remainder(0.777) + 1).fmod(0.43) * 2, x.abs() + 3

    assert run_hot(f, [x]) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()
    assert f(x.to("mgpu"))[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_remainder_and_floor_division_by_infinity_are_eager_s(tiered, no_trial, dtype):
    # Inductor computes a % b as a - floor(a / b) * b and a // b as
    # floor(a / b): NaN for 0 % inf, -0.0 for 1.59 // -inf, where eager
    # gives 0 and -1 (difffuzz seeds 3750026, 3750483). The replay computes
    # them by eager's CPU formula: equal bits, in-place and out= too.
    g = torch.Generator().manual_seed(2)
    special = [0.0, -0.0, 1.59, -1.59, 7.25, float("inf"), float("-inf"), float("nan")]
    a = torch.cat([torch.tensor(special).repeat_interleave(8), torch.randn(64, generator=g) * 10]).to(dtype)
    b = torch.cat([torch.tensor(special).repeat(8), torch.randn(64, generator=g) * 3]).to(dtype)

    def f(a, b):
        r = (a * 1.0).remainder(b)
        q = torch.floor_divide(a + 0.0, b)
        d = torch.div(a - 0.0, b, rounding_mode="floor")
        w = a.clone()
        w.remainder_(float("inf"))
        o = torch.empty_like(a)
        torch.remainder(a, -3.5, out=o)
        return r, q, d, w.floor_divide_(float("-inf")), o + 0.0

    assert run_hot(f, [a, b]) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()
    for w, t in zip(f(a, b), f(a.to("mgpu"), b.to("mgpu"))):
        torch.testing.assert_close(t.cpu(), w, rtol=0, atol=0, equal_nan=True)
        signs = [torch.signbit(x) & ~x.isnan() for x in (t.cpu(), w)]  # a NaN's sign is no value's
        assert torch.equal(*signs)  # -0.0 as eager's
    assert torch_mgpu.last_plan().tier == 1


@pytest.mark.parametrize("number, compiles", [(lambda k: k, True), (lambda k: bool(k % 2), True),
                                              (lambda k: torch.tensor(k), False),
                                              (lambda k: torch.tensor(k % 3, dtype=torch.uint8), False)],
                         ids=["int", "bool", "int tensor", "uint8 tensor"])
def test_compiled_code_never_runs_with_another_integer_constant(tiered, no_trial, number, compiles):
    # A Python int or bool is a 0-dim CPU tensor in the recorded call
    # (`x + k`, as a 0-dim tensor passed to it), which the structural hash
    # sees by dtype only; compiled code bakes its value in. Its value was
    # not part of what compiled code must match: `x.sqrt() + k` ran the code
    # compiled for k = 2 at every later step (silently off by k - 2), and
    # `x + torch.tensor(k)` (a 0-dim tensor, which is not compiled) ran the
    # code of `x + 2`.
    x = torch.rand(8, generator=torch.Generator().manual_seed(5)) + 0.1
    xm = x.to("mgpu")
    for k in range(1, 8):
        want = x.sqrt() * 1.5 + number(k)
        torch.testing.assert_close((xm.sqrt() * 1.5 + number(k)).cpu(), want)
        if k == 2:
            assert torch_mgpu.wait_for_compiles(300)
    # With the same value each step, a number's graph still reaches tier 1.
    for k in range(4):
        torch.testing.assert_close((xm.sqrt() * 1.5 + number(2)).cpu(), x.sqrt() * 1.5 + number(2))
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert torch_mgpu.last_plan().tier == (1 if compiles else 0)


def test_a_number_divided_by_infinity_is_eager_s(tiered, no_trial):
    # `3.0 // x` and `2.5 % x` (a number as self): eager gives -1 for
    # 3.0 // -inf, inductor's floor(a / b) -0.0 (difffuzz seed 3810566).
    special = [0.0, -0.0, 1.39, -0.48, float("inf"), float("-inf"), float("nan"), 2.5]
    x = torch.cat([torch.tensor(special), torch.randn(24, generator=torch.Generator().manual_seed(4)) * 4])

    def f(x):
        y = x * 1.0
        return 3.0 // y, 2.5 % y, (-1.59) // y, torch.remainder(-7.25, y)

    assert run_hot(f, [x]) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()
    for w, t in zip(f(x), f(x.to("mgpu"))):
        torch.testing.assert_close(t.cpu(), w, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(*[torch.signbit(v) & ~v.isnan() for v in (t.cpu(), w)])
    assert torch_mgpu.last_plan().tier == 1


def test_optimizer_arithmetic_rounds_as_eager_s_fused_multiply_add(tiered, no_trial):
    # Eager's float32 kernels of add/sub with alpha, addcmul and lerp round
    # once (a fused multiply-add), addcdiv multiplies before it divides;
    # inductor's code rounds the product first or divides first: about one
    # result in six a unit in the last place off (difffuzz seed 3810534,
    # an argmax over such results). The replay keeps eager's rounding: the
    # same bits, in-place and out= too.
    g = torch.Generator().manual_seed(7)
    s, a, b, w = (torch.randn(512, generator=g) for _ in range(4))
    b = b.abs() + 0.5
    # Zero results: +0.0 in eager's lerp, whichever weight.
    s[:8], a[:8], s[8:12], a[8:12] = 0.0, 0.0, -3.0, 1.0

    def f(s, a, b, w):
        o = torch.empty_like(s)
        torch.addcmul(s, a, b, value=0.3, out=o)
        t = s.clone()
        t.addcdiv_(a, b, value=-0.7)
        return (torch.add(s, a, alpha=0.3), s.sub(a, alpha=1.7), torch.addcmul(s, a, b), o, t,
                torch.lerp(s, a, 0.3), s.lerp(a, 0.7), torch.lerp(s, a, w), s.clone().lerp_(a, -0.2),
                torch.addcmul(s, a, b, value=-2.5) * 1.0, (s * 1.0).add_(a, alpha=-1e-2),
                torch.lerp(s, a, 0.75), s.lerp(a, 1.0), torch.lerp(s, a, w.abs() + 0.5))

    assert run_hot(f, [s, a, b, w], exact=True) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()
    for want, got in zip(f(s, a, b, w), f(*(t.to("mgpu") for t in (s, a, b, w)))):
        assert torch.equal(torch.signbit(got.cpu()), torch.signbit(want))  # +0.0 as eager's (equal holds -0.0 == 0.0)
    assert torch_mgpu.last_plan().tier == 1
    # A value of False multiplies as 0.0 does (inductor folds a product
    # with False to 0): inf * False is NaN, as in eager.
    a[:4] = float("inf")

    def g(s, a, b):
        return torch.addcmul(s, a, b, value=False), torch.addcdiv(s * 1.0, a, b, value=False)

    assert run_hot(g, [s, a, b]) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()
    assert g(s, a, b)[0][:4].isnan().all()


def test_sgd_steps_with_a_schedule_in_tier_1_are_eager_s_bits(tiered, no_trial):
    # SGD's update p.add_(g, alpha=-lr), the schedule's lr an input of the
    # compiled graph (rounded to float32 as it is passed, as eager's kernel
    # takes it), rounds as eager's kernel: the parameters after each step
    # in tier 1 are eager's to the bit.
    ref, got = make_training("cpu", False, torch.optim.SGD), make_training("mgpu", False, torch.optim.SGD)
    params = list(got[0].parameters())
    tiers = []
    for k in range(6):
        # The step's gradients as eager's: only the update is compared.
        for model in (ref[0], got[0]):
            for p, q in zip(model.parameters(), ref[0].parameters()):
                p.grad = torch.sin(q.detach() * 3.0 + k).to(p.device)
        for opt, sched in (ref[1:], got[1:]):
            opt.step()
            sched.step()
        for p, q in zip(params, ref[0].parameters()):
            assert torch.equal(p.detach().cpu(), q.detach()), k
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 2:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers[3:] == [1] * 3, (tiers, torch_mgpu._C._tier_last_error())
    assert "constant(s) as inputs" in torch_mgpu.last_plan().compiled


def test_remainder_of_half_precision_stays_in_tier_0(tiered, no_trial):
    a = torch.randn(16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def f(a):
        return ((a * 2).remainder(float("inf")) + 1,)

    assert run_hot(f, [a]) == [0, 0, 0, 0]
    assert "half or bfloat16" in torch_mgpu._C._tier_last_error()


def test_the_dtype_an_op_computes_in_decides_rounding_and_formula(tiered, no_trial):
    # Decided by the inputs' promoted dtype, not the dtype written: a float32
    # sum written into a bfloat16 tensor keeps the number as float32; a
    # divisor nonzero as a Python float is 0 in float32 (eager divides by
    # 0 there: inf); integers divided into a float out= stay integer
    # division (review of the change above: each differed from eager).
    g = torch.Generator().manual_seed(6)
    p = torch.randn(256, generator=g).to(torch.bfloat16)
    u = torch.randn(256, generator=g)
    big = torch.randint(2 ** 39, 2 ** 41, (64,), generator=g)
    cases = [
        (lambda p, u: p.neg().add_(u * 1.5, alpha=2.7856), [p, u]),
        (lambda p, u: torch.add(u.neg(), 2.7856, out=torch.empty(256, dtype=torch.bfloat16, device=u.device)) * 2, [p, u]),
        (lambda p, u: (u.neg() // 1e-50, torch.div(u.abs(), 1e-50, rounding_mode="floor")), [p, u]),
        (lambda big: torch.floor_divide(big.neg(), 7, out=torch.empty(64, device=big.device)) + 1, [big]),
    ]
    for n, (f, inputs) in enumerate(cases):
        tiers = run_hot(f, inputs, exact=True)
        assert tiers == [0, 0, 1, 1], (n, tiers, torch_mgpu._C._tier_last_error())


def test_a_varying_number_added_to_bfloat16_is_an_input_rounded_as_eager_rounds_it(tiered, no_trial):
    p = torch.randn(256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    pm = p.to("mgpu")
    tiers = []
    for k in range(6):
        c = 0.1 * 0.9 ** k + 2.5
        assert torch.equal((pm.neg() + c).cpu(), p.neg() + c), k
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers == [0, 0, 1, 1, 1, 1], torch_mgpu._C._tier_last_error()
    assert "constant(s) as inputs" in torch_mgpu.last_plan().compiled


def test_a_half_precision_product_with_one_row_of_400_products_stays_in_tier_0(tiered, no_trial):
    # Eager's CPU bmm takes a BLAS there, whose sums neither inductor's code
    # nor float32 sums match.
    g = torch.Generator().manual_seed(12)
    a, b = (torch.randn(*s, generator=g).to(torch.float16) for s in [(1, 40), (40, 10)])

    def f(a, b):
        return (torch.einsum("ij,jk->ik", a * 2, b),)

    assert run_hot(f, [a, b], atol=0) == [0, 0, 0, 0]
    assert "400 or more products" in torch_mgpu._C._tier_last_error()


def test_a_reduction_into_an_out_of_another_dtype_reduces_in_its_dtype(tiered, no_trial):
    # Eager casts the input to out='s dtype and reduces there (a float16
    # sum into int64 truncates each element first: difffuzz seed 3790022);
    # the traced decomposition reduced, then cast.
    g = torch.Generator().manual_seed(11)
    h = (torch.randn(64, generator=g) * 3).to(torch.float16)
    f32 = torch.randn(4096, generator=g)

    def f(h, f32):
        outs = [torch.empty(0, dtype=dt, device=h.device) for dt in
                (torch.int64, torch.int64, torch.int64, torch.int64, torch.float64, torch.float64, torch.float64)]
        torch.sum(h * 1, 0, out=outs[0])
        torch.cumsum(h + 0, 0, out=outs[1])
        torch.prod(h[:6] - 0, 0, out=outs[2])
        torch.cumprod(h[:6] * 1, 0, out=outs[3])
        torch.mean(f32 * 1, 0, out=outs[4])
        torch.nansum(f32 + 0, 0, out=outs[5])
        torch.sum(f32.view(64, 64) - 0, 1, out=outs[6])
        return tuple(o + 0 for o in outs)

    assert run_hot(f, [h, f32], exact=True) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_product_with_one_row_or_column_is_eager_s(tiered, no_trial, dtype):
    # Inductor's CPU bmm with one row or one column is a sum of products,
    # each rounded to the half dtype first where precision casts are
    # emulated; eager sums the float32 products (difffuzz seed 3780045:
    # einsum of a (1, 2) by a (2, 2) float16, one unit in the last place off).
    # Products of more rows and columns are eager's own kernel in both.
    g = torch.Generator().manual_seed(10)
    a, b, c, d, e = (torch.randn(*s, generator=g).to(dtype) for s in [(1, 6), (6, 7), (4, 1, 6), (2, 5, 40), (2, 40, 9)])

    def f(a, b, c, d, e):
        return (torch.einsum("ij,jk->ik", a * 1.5, b), torch.bmm(c, b.expand(4, 6, 7)) - 1,
                torch.einsum("ij,jk->ik", b.t(), a.t() * 2), torch.bmm(d * 2, e))

    assert run_hot(f, [a, b, c, d, e], exact=True) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()


def test_integer_products_compile_in_their_dtype_and_wrap_as_eager_s(tiered, no_trial):
    # Inductor's CPU decomposition of a product with one row or one column
    # sums in int64 and returns int64: a uint8 bmm over 1x3x3 and 1x3x1
    # "returned a tensor that does not fit its value", and the graph went
    # back to tier 0 after a wasted compile. Integer products are traced as
    # sums of products in their own dtype; sums that overflow wrap as
    # eager's do.
    g = torch.Generator().manual_seed(3)

    def ints(*shape, dtype=torch.uint8, high=256):
        return torch.randint(0, high, shape, generator=g).to(dtype)

    a, b, c, d, e = ints(1, 3, 3), ints(1, 3, 1), ints(1, 5), ints(5, 1), ints(1, 1)
    i, j = ints(2, 4, 7, dtype=torch.int32, high=1000), ints(2, 7, 1, dtype=torch.int32, high=1000)

    def f(a, b, c, d, e, i, j):
        return (torch.bmm(a, b) + 0, torch.mm(c, d) * 3, torch.addmm(e, c, d, beta=2, alpha=3), torch.baddbmm(b, a, b),
                torch.einsum("bij,bjk->bik", i, j * 1000000) - 1, torch.matmul(i[0], j[1]) + 1)

    before = tier1_stats()
    assert run_hot(f, [a, b, c, d, e, i, j], exact=True) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()
    assert tier1_stats()["tier1_fallbacks"] == before["tier1_fallbacks"]


def test_erf_near_zero_and_a_product_with_false_are_eager_s(tiered, no_trial):
    # Inductor's float32 erf is off by up to 4.5e-4 relative near 0 (seed
    # 3760451: 1 / erf(x)^2); it folds x * False to 0 where NaN * False is
    # NaN (seed 3760406).
    x = torch.randn(257, generator=torch.Generator().manual_seed(9)) * 0.05

    def f(x):
        return torch.reciprocal(x.erf() ** 2), torch.log(x) * False, torch.erf(x * 3) + 1

    assert run_hot(f, [x]) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()


def test_a_split_graph_takes_a_changing_constant_as_an_input(tiered, no_trial, two_lanes):
    # A scale that changes every step (a schedule's learning rate) in one
    # tower: an input of the part that uses it, not a compile per step.
    cpu = tower_inputs(3, 396)
    mg = [t.to("mgpu") for t in cpu]

    def f(a, b, c, d, acc, lr):
        return torch.tanh(a @ b) * lr + torch.relu(c @ d)

    before = tier1_stats()
    tiers = []
    for k in range(7):
        lr = 0.5 / (1 + k)
        torch.testing.assert_close(f(*mg, lr).cpu(), f(*cpu, lr), rtol=1e-4, atol=1e-4)
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers[2:] == [1] * 5, torch_mgpu._C._tier_last_error()
    plan = torch_mgpu.last_plan()
    assert "parts on 2 lanes" in plan.compiled and "constant(s) as inputs" in plan.compiled, plan.compiled
    assert tier1_stats()["tier1_compiled"] - before["tier1_compiled"] == 1


def test_parts_that_wait_for_each_other_across_the_lanes(tiered, no_trial, two_lanes):
    # Two stages of two towers each, the second stage reading both towers
    # of the first: parts on each lane wait for the other lane's earlier
    # part, in turn, and never for one that waits for them.
    g = torch.Generator().manual_seed(4)
    cpu = [torch.randn(352, 352, generator=g) for _ in range(4)]
    mg = [t.to("mgpu") for t in cpu]

    def f(a, b, c, d):
        left, right = torch.tanh(a @ b), torch.relu(c @ d)
        mixed = left * 0.5 + right
        left2, right2 = torch.tanh(mixed @ a), torch.sigmoid(right @ mixed)
        return left2 - right2, mixed.sum()

    run_hot(f, cpu, mg, atol=1e-3)
    plan = torch_mgpu.last_plan()
    assert plan.tier == 1, torch_mgpu._C._tier_last_error()
    assert " parts on 2 lanes" in plan.compiled and " then " in plan.compiled, plan.compiled


def test_many_small_branches_are_bundled_into_parts_for_the_lanes(tiered, no_trial, two_lanes):
    # 32 small feature transforms and their join: each too small for a call
    # of its own, bundled (siblings) into pieces the lanes share, then a
    # lane's pieces joined into one part; the join after both lanes.
    g = torch.Generator().manual_seed(5)
    cols = [torch.randn(4096, generator=g) * (1 + j % 3) + j for j in range(32)]
    colsm = [c.to("mgpu") for c in cols]

    def f(cs):
        out = []
        for c in cs:
            z = ((c - c.mean()) / (c.std() + 1e-6)).clamp(-3.0, 3.0)
            out.append(torch.tanh(z * 0.5) * torch.sigmoid(z) - z * z * 0.1)
        return torch.stack(out, 1)

    run_hot(lambda *cs: (f(cs),), cols, colsm, atol=1e-4)
    plan = torch_mgpu.last_plan()
    assert plan.tier == 1, torch_mgpu._C._tier_last_error()
    assert " parts on 2 lanes" in plan.compiled, plan.compiled


def test_a_trunk_read_by_heads_on_both_lanes_is_a_part_of_its_own(tiered, no_trial, two_lanes):
    # A product written in place (a fresh value's new version) and read by
    # two heads: the trunk ends its part, so the head on the other lane
    # waits for the trunk only; the written value crosses as its storage's
    # bytes.
    g = torch.Generator().manual_seed(6)
    cpu = [torch.randn(360, 360, generator=g) for _ in range(4)]
    mg = [t.to("mgpu") for t in cpu]

    def f(a, b, c, d):
        h = a @ b
        h.relu_()
        return torch.tanh(h @ c) + torch.sigmoid(h @ d), h

    before = tier1_stats()
    run_hot(f, cpu, mg, atol=1e-3)
    plan = torch_mgpu.last_plan()
    assert plan.tier == 1, torch_mgpu._C._tier_last_error()
    assert " parts on 2 lanes" in plan.compiled, plan.compiled
    assert tier1_stats()["tier1_fallbacks"] == before["tier1_fallbacks"]


def test_a_trial_whose_constants_never_match_ends_in_tier_0(tiered):
    # clamp's bound is compiled in; from the compile on it changes every
    # run, so the compiled code never matches: the trial gives up after its
    # runs (tier 0 all along) instead of staying on trial for ever.
    x = torch.randn(8, 8)
    xm = x.to("mgpu")

    def f(t, lo):
        return torch.clamp(torch.cos(t), min=lo) * 3

    for _ in range(2):
        f(xm, -0.5).cpu()
    assert torch_mgpu.wait_for_compiles(300)
    tiers = []
    for k in range(26):
        lo = -0.4 + k * 0.01
        torch.testing.assert_close(f(xm, lo).cpu(), f(x, lo), rtol=1e-4, atol=1e-5)
        tiers.append(torch_mgpu.last_plan().tier)
    assert set(tiers) == {0}
    assert "could not be timed in its trial" in torch_mgpu._C._tier_last_error()
    f(xm, -0.5).cpu()  # the value compiled in: the code was let go of
    assert torch_mgpu.last_plan().tier == 0


def test_a_graph_is_compiled_for_each_lanes_it_gets_hot_on(tiered, no_trial, two_lanes):
    cpu = tower_inputs(3, 288)
    mg = [t.to("mgpu") for t in cpu]
    run_hot(towers, cpu, mg, atol=1e-3)
    plan = torch_mgpu.last_plan()
    assert plan.tier == 1 and " parts on 2 lanes" in plan.compiled, plan.compiled
    before = tier1_stats()
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=1)
    # Code compiled for two lanes is not called on one (it would fail and be
    # dropped): on one lane the graph gets hot and compiled anew, whole.
    assert run_hot(towers, cpu, mg, atol=1e-3) == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()
    plan = torch_mgpu.last_plan()
    assert " parts " not in plan.compiled and plan.lanes == ["cpu:0/lane0"], (plan.compiled, plan.lanes)
    assert tier1_stats()["tier1_fallbacks"] == before["tier1_fallbacks"]
    assert tier1_stats()["tier1_compiled"] - before["tier1_compiled"] == 1
    # Back on two lanes, the parts compiled for them run at once.
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2)
    want = towers(*cpu)
    for w, t in zip(want, towers(*mg)):
        torch.testing.assert_close(t.cpu(), w, rtol=1e-4, atol=1e-3)
    assert torch_mgpu.last_plan().tier == 1 and " parts on 2 lanes" in torch_mgpu.last_plan().compiled


@pytest.mark.parametrize("norm", ["batch_norm", "layer_norm_t"])
def test_a_view_of_a_result_laid_out_otherwise_in_the_trace(tiered, no_trial, norm):
    # Eager's batch norm of a transposed input is contiguous (so is the
    # recorded result); the traced decomposition keeps the input's strides.
    # A view that reads the result by strides (reshape(-1), a slice) reads
    # the bytes as the recording lays them out, not the traced result's
    # (difffuzz seed 3720018: two elements swapped).
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5))

    def f(a):
        if norm == "batch_norm":
            y = torch.nn.functional.batch_norm(a.t(), None, None, training=True)
        else:
            y = torch.nn.functional.layer_norm(a.t(), (4,)) * 2.0
        return y.reshape(-1) * 1.5, y[1:, ::2] + 1.0, y.t()[2] - 0.5, y.t() * 3.0, y.unsqueeze(0).transpose(0, 2) - 1

    tiers = run_hot(f, [x], atol=1e-4)
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_a_write_through_a_view_of_a_result(tiered, no_trial):
    # A result written in place through a view other than itself (a slice
    # of a transposed product): the write lands in its recorded bytes.
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(5, 3, generator=g), torch.randn(3, 5, generator=g)

    def f(a, b):
        y = torch.nn.functional.batch_norm(a.t(), None, None, training=True) + b
        y[:, 1:3] = -2.0
        y.t()[0].mul_(3.0)
        return y * 1.0, y.reshape(-1)[4:9] + 1.0

    tiers = run_hot(f, [a, b], atol=1e-4)
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_a_result_written_as_itself_then_read_through_a_view(tiered, no_trial):
    # relu_ writes the product in place as the product itself (it keeps its
    # recorded geometry); the slice then reads its bytes laid out.
    a = torch.randn(5, 3, generator=torch.Generator().manual_seed(6))

    def f(a):
        y = a @ a.t()
        y.relu_()
        z = torch.nn.functional.batch_norm(a.t(), None, None, training=True)
        z.mul_(2.0)
        return y[1:, :2] * 2.0, z.reshape(-1)[4:9] + 1.0

    tiers = run_hot(f, [a], atol=1e-4)
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_an_empty_result_resized_as_an_out_tensor(tiered, no_trial):
    x = torch.randn(6, generator=torch.Generator().manual_seed(8))

    def f(x):
        out = x[:0] * 1.0
        torch.mul(x, 2, out=out)
        return out + 1, out[::2] * 3

    tiers = run_hot(f, [x], atol=1e-5)
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_complex_graphs_stay_in_tier_0(tiered, no_trial):
    # Inductor's code lost the write of a slice's fill_ into a complex tensor
    # read transposed after it (difffuzz seed 3720218): tier 0 runs them.
    z = torch.randn(4, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(7))

    def f(z):
        z = z.clone()
        z[:, 0:1] = -1
        return z.t().contiguous() * 2, z.abs().isnan()

    tiers = run_hot(f, [z], atol=1e-5)
    assert tiers == [0, 0, 0, 0]
    assert "complex tensors" in torch_mgpu._C._tier_last_error()


def test_a_bool_sum_with_alpha_stays_in_tier_0(tiered, no_trial):
    # Inductor's CPU code for add(bool, bool, alpha=0) stores int64 vectors
    # through the bool result's pointer, past its buffer: the heap was
    # corrupted (difffuzz seed 3730162). Tier 0 runs such graphs.
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(9))

    def f(x):
        b = x > 0
        b.add_(b, alpha=0)
        return b, (x * 2).sum(0)

    tiers = run_hot(f, [x])
    assert tiers == [0, 0, 0, 0]
    assert "a sum of bool tensors with an alpha other than 1" in torch_mgpu._C._tier_last_error()
    # A bool sum with alpha 1 (a logical or) compiles.
    tiers = run_hot(lambda x: (torch.add(x > 0, x < 0.5), x * 3), [x])
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_an_integer_op_with_a_fractional_beta_stays_in_tier_0(tiered, no_trial):
    # Eager casts addmm's beta=0.5 to int64 (0) before it scales `input`;
    # inductor's code scaled by 0.5 and rounded after (difffuzz seed
    # 3965240: every element one or two apart). Tier 0 runs such graphs.
    gen = torch.Generator().manual_seed(3)
    m = torch.randint(-4, 5, (3, 1), generator=gen)
    r = torch.randint(-4, 5, (1, 3), generator=gen)
    x = torch.randn(4, generator=gen)

    def f(m, r, x):
        return torch.addmm(r, m, r, beta=0.5, alpha=2), x * 2

    tiers = run_hot(f, [m, r, x], exact=True)
    assert tiers == [0, 0, 0, 0]
    assert "an integer op with a fractional alpha or beta" in torch_mgpu._C._tier_last_error()
    # A fractional beta over floats compiles.
    tiers = run_hot(f, [m.double(), r.double(), x])
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8])
def test_the_index_of_a_min_or_max_over_byte_values_is_eagers_in_compiled_code(tiered, no_trial, dtype):
    # Inductor's vectorized min with indices over one-byte values along the
    # innermost dim returned other indices than eager's first minimum, some
    # holding no minimum (difffuzz seed 3965385: 50 of 112; torch.compile
    # alone does the same). The replay reduces int32 values instead.
    x = torch.randint(0, 2, (4, 28, 79), generator=torch.Generator().manual_seed(711)).to(dtype)

    def f(x):
        v, i = x.min(-1)
        w, j = x.max(-1)
        return v, i, w, j, x.argmin(-1) if dtype != torch.bool else i, x.sum(-1) * 2

    tiers = run_hot(f, [x], exact=True)
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_a_cat_read_through_a_view_after_it_is_written_in_compiled_code(tiered, no_trial):
    # A stack's gradient (difffuzz seed 3968789): inductor wrote the cat's
    # inputs straight into views of its buffer, and fused a reader of that
    # buffer (through the replay's as_strided view) into a loop before those
    # writes: uninitialized bytes in u and r. Compiled cats are loops of
    # their own (force_pointwise_cat).
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(725))

    def f(x):
        y = torch.sigmoid(x.mT)
        g = torch.empty((), device=x.device).fill_(1.0).expand(2, 3, 3) / 18
        c = torch.cat([y, y * 2], 0).view(2, 3, 3)
        s = g * c + c * g
        u = s[0] + s[1] * 2
        return torch.ops.aten.sigmoid_backward(u, y).mT, y, u

    tiers = run_hot(f, [x])
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_only_a_cat_read_in_the_graph_is_compiled_as_a_loop_of_its_own(tiered, no_trial, monkeypatch):
    # A cat only returned keeps inductor's way (its inputs' producers write
    # into its buffer): as a loop of its own, a stack of many columns
    # computed every column's chain again for each element (the features
    # benchmark, 6x slower). A cat read in the graph stays a loop of its own
    # (the test above).
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import config as inductor_config

    seen = []
    real = compile_fx_module.compile_fx

    def spy(*args, **kwargs):
        seen.append(inductor_config.force_pointwise_cat)
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    g = torch.Generator().manual_seed(726)
    cols = [torch.randn(40, generator=g) * (1 + j) for j in range(5)]

    def returned(*cols):
        return torch.stack([(c - c.mean()).tanh() * 2 for c in cols], 1)

    def read(*cols):
        c = torch.cat([(c - c.mean()).tanh() for c in cols])
        return c.view(5, 40).sum(0) * 2

    def into(*cols):  # a cat into an out= tensor: its buffer's views are read, not the cat
        buf = torch.empty(0, device=cols[0].device)
        torch.cat([(c - c.mean()).tanh() * 3 for c in cols], out=buf)
        return buf.view(5, 40).sum(0) * 2

    for f, forced in ((returned, False), (read, True), (into, True)):
        seen.clear()
        tiers = run_hot(f, cols)
        assert tiers == [0, 0, 1, 1], (f.__name__, tiers, torch_mgpu._C._tier_last_error())
        # The whole graph, and its parts where it has branches on two lanes.
        assert seen and seen[0] is forced, (f.__name__, seen)


def with_infinities(t, seed):
    t = t.clone()
    g = torch.Generator().manual_seed(seed)
    flat = t.view(-1)
    spots = torch.randperm(flat.numel(), generator=g)[:max(4, flat.numel() // 8)]
    flat[spots[0::2]] = float("inf")
    flat[spots[1::2]] = float("-inf")
    return t


@pytest.mark.parametrize("lanes", ["whole", "parts"])
def test_linear_bilinear_and_bicubic_upsampling_compute_as_their_kernels_in_compiled_code(tiered, no_trial, lanes):
    # The decompositions of linear upsampling interpolate x0 + (x1 - x0) * w:
    # NaN where the kernel's x0 * (1 - w) + x1 * w is +-inf (difffuzz seed
    # 3967375: an infinite x0, a finite x1, w = 0). Compiled code calls the
    # kernels. The parts variant runs them in C++-wrapped parts on two lanes.
    F = torch.nn.functional
    n = 200 if lanes == "parts" else 6
    g = torch.Generator().manual_seed(12)
    a, b, c, d = (torch.randn(n, n, generator=g, dtype=torch.float64) for _ in range(4))
    inf = with_infinities(torch.randn(n, n, generator=g, dtype=torch.float64), 13)

    def f(a, b, c, d, inf):
        left = F.interpolate((a @ b + inf).view(1, n, n), scale_factor=2, mode="linear")
        right = (c @ d + inf).view(1, 1, n, n)
        return (left * 1, F.interpolate(right, scale_factor=2, mode="bilinear") * 1,
                F.interpolate(right.to(torch.bfloat16), size=(n + 3, n + 5), mode="bicubic", align_corners=True) * 1)

    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2 if lanes == "parts" else 1)
    try:
        tiers = run_hot(f, [a, b, c, d, inf], atol=1e-6)
        plan = torch_mgpu.last_plan()
    finally:
        torch_mgpu.configure(**torch_mgpu._configuration_of(*before))
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())
    assert (" parts on 2 lanes" in plan.compiled) == (lanes == "parts"), plan.compiled


def test_a_write_that_reads_its_own_storage_through_another_view_stays_in_tier_0(tiered, no_trial):
    # copy_ from a view of the tensor it writes: eager's kernel reads
    # elements it has already written (difffuzz seed 3730403); compiled
    # code would read them all first. Tier 0 runs such graphs.
    v = torch.tensor([[[-3, 3], [4, -2]], [[5, 3], [4, -1]]])

    def f(v):
        v = v.clone()
        v.copy_(v.select(1, -1))
        return v * 2, v.roll(-2, 1)

    tiers = run_hot(f, [v])
    assert tiers == [0, 0, 0, 0]
    assert "reads the storage it writes through another view" in torch_mgpu._C._tier_last_error()
    # The same tensor read and written as itself compiles (`x.mul_(x)`).
    tiers = run_hot(lambda x: (x.clone().mul_(3).add_(1) * 2,), [torch.randn(6, 2)])
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_a_write_through_a_view_that_overlaps_itself_stays_in_tier_0(tiered, no_trial):
    # index_put_ through `unfold(0, 2, 1)` (rows 0-1, 1-2, 2-3 of one
    # storage): eager writes element after element, so a later index's
    # write lands over an earlier one's; compiled code wrote each index
    # once from values read before (difffuzz seed 3962753: rows 0-2 set to
    # 1 in eager, not in tier 1). Tier 0 runs such graphs.
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)

    def f(x):
        v = x * 2
        v.unfold(0, 2, 1).index_put_((torch.tensor([1, 0]),), torch.ones(2, dtype=torch.bfloat16))
        return v, v.sum(0)

    tiers = run_hot(f, [x], exact=True)
    assert tiers == [0, 0, 0, 0]
    assert "a write through a view that overlaps itself" in torch_mgpu._C._tier_last_error()
    # A write through a strided view that does not overlap itself compiles.
    tiers = run_hot(lambda x: (lambda v: (v.t()[1:].mul_(3), v * 2))(x * 2), [x], exact=True)
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_a_product_with_zero_keeps_nan_and_inf(tiered, no_trial):
    # `0 / x` records reciprocal(x) * 0; inductor folds a product with the
    # integer 0 to 0, where eager's NaN * 0 and inf * 0 are NaN (difffuzz
    # seed 3740135). The replay passes 0.0, which it leaves alone.
    x = torch.tensor([float("nan"), 0.0, 2.0, float("inf")], dtype=torch.float64)

    def f(x):
        y = x * 1.5
        z = x.clone()
        z.mul_(0)
        return 0 / y, y * 0, z, torch.arange(4) * 0

    tiers = run_hot(f, [x])
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_a_zero_tensor_returned_by_compiled_code_reads_as_zeros(tiered, no_trial):
    # The gradient of a sign is autograd's `_efficientzerotensor`, which
    # inductor returns as a ZeroTensor: a storage with no bytes behind it.
    # Tier 1 kept that storage as the value's bytes, and reading the value
    # crashed the process (difffuzz seed 3811503).
    def f(x):
        x = x.detach().requires_grad_()
        g, = torch.autograd.grad(x.abs().sum(), [x], create_graph=True)
        gg, = torch.autograd.grad(g.exp().sum(), [x])
        return g.detach(), gg

    tiers = run_hot(f, [torch.tensor([2.11, -0.02, 0.5])], exact=True)
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_a_view_of_a_buffer_written_later_reads_it_before_the_write(tiered, no_trial):
    # Inductor's code for an as_strided view of a buffer the graph made
    # read it after a later copy into the same bytes: `y =
    # x.repeat_interleave(2)` (a copy of an expanded view of x), then
    # `x[:] = z`, gave y z's values (difffuzz seed 3811486).
    def f(x, i):
        a = x * x
        b = a.relu()
        z = b.index_select(0, i)
        v = x.view(-1)
        v.fill_(True)
        y = v.repeat_interleave(2, 0)
        v[:] = z
        return x, a, b, z, y

    tiers = []
    for k in range(4):
        want = f(torch.tensor([0.0, -1.13, -1.2]), torch.tensor([0, 1, 0]))
        got = f(torch.tensor([0.0, -1.13, -1.2]).to("mgpu"), torch.tensor([0, 1, 0]).to("mgpu"))
        for w, t in zip(want, got):
            assert torch.equal(t.cpu(), w), (k, t.cpu(), w)
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_strided_reads_of_a_made_buffer_are_as_strided_s():
    from torch_mgpu._tiers import _strided_read
    g = torch.Generator().manual_seed(11)
    flat = torch.randn(200, generator=g)
    geometries = [([3, 2], [1, 0], 0), ([4], [2], 3), ([2, 3], [1, 2], 5), ([2, 3, 4], [12, 1, 3], 1),
                  ([], [], 7), ([5, 1, 2], [4, 9, 1], 2), ([0, 3], [3, 1], 0), ([3, 3], [2, 1], 0),
                  ([2, 2, 2], [0, 5, 1], 9), ([3, 4], [10, 2], 4)]
    for _ in range(40):
        n = int(torch.randint(1, 4, (), generator=g))
        sizes = torch.randint(1, 5, (n,), generator=g).tolist()
        strides = torch.randint(0, 9, (n,), generator=g).tolist()
        geometries.append((sizes, strides, int(torch.randint(0, 20, (), generator=g))))
    for sizes, strides, offset in geometries:
        want = torch.as_strided(flat, sizes, strides, offset)
        assert torch.equal(_strided_read(flat, sizes, strides, offset), want), (sizes, strides, offset)
    # Expanded dims, steps, and columns of a matrix are views (no gather).
    for sizes, strides, offset in [([3, 2], [1, 0], 0), ([4], [2], 3), ([3, 4], [10, 2], 4), ([6, 2], [5, 1], 1)]:
        assert _strided_read(flat, sizes, strides, offset)._base is flat


def test_a_quotient_that_overflows_floor_divides_as_eager(tiered, no_trial):
    # 1 // 1.4e-45 is inf in eager (its fmod is exact: 0); inductor's fmod
    # is NaN where a / b overflows, and its floor division was NaN
    # (difffuzz seed 3811374).
    tiny = torch.tensor([1.4013e-45, -1.4013e-45, 1e-40, 3e-39, 1.4013e-45, -2e-44, 1e-40, 1e-38])
    a = torch.tensor([1.0, 3.0, -4.0, 2.5, 0.0, float("inf"), float("nan"), 1e30])

    def f(a, b):
        y = b * 1.0
        return torch.floor_divide(a, y), torch.div(a * 1.0, y, rounding_mode="floor"), (a * 2) // y

    tiers = run_hot(f, [a, tiny])
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_a_conversion_to_bool_is_nonzero_in_compiled_code(tiered, no_trial):
    # `.bool()` records a copy_ into a bool tensor; inductor's code fused it
    # with an arange and dropped the conversion (difffuzz seed 3915445:
    # arange(3).bool() + -1.5 gave 0.5 where eager gives -0.5).
    def f(x, n):
        flags = torch.arange(5, device=x.device).bool()
        return flags + -1.5 + x, n.bool() * 2.5

    x = torch.randn(5)
    n = torch.tensor([0, 3, -2, 0, 7])
    tiers = run_hot(f, [x, n], exact=True)
    assert tiers[-1] == 1, torch_mgpu._C._tier_last_error()


@pytest.mark.parametrize("mode", ["train", "train_no_stats", "eval"])
def test_batch_norm_in_compiled_code_is_eagers_scale_and_shift(tiered, no_trial, mode):
    # Eager's CPU kernel computes x * alpha + beta with alpha = invstd *
    # weight and beta = bias - mean * alpha per channel; the decomposition
    # computes (x - mean) * invstd * weight + bias. With an infinite weight
    # eager gives NaN (inf - inf) where the decomposition gives +-inf
    # (difffuzz seed 3914835).
    def f(x, w, b, rm, rv):
        if mode == "train_no_stats":
            out = torch.nn.functional.batch_norm(x, None, None, w, b, training=True, momentum=0.5)
        else:
            out = torch.nn.functional.batch_norm(x, rm, rv, w, b, training=mode == "train", momentum=0.5)
        return out * 1.0, rm + 0, rv + 0

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 5, generator=g)
    w = torch.randn(4, generator=g)
    w[1] = float("-inf")
    w[2] = float("inf")
    b = torch.randn(4, generator=g)
    rm = torch.randn(4, generator=g)
    rv = torch.rand(4, generator=g) + 0.5
    # Fresh running statistics each run on both sides: the kernel writes them.
    tiers = run_hot(lambda *t: f(t[0], t[1], t[2], t[3].clone(), t[4].clone()), [x, w, b, rm, rv])
    assert tiers[-1] == 1, torch_mgpu._C._tier_last_error()
    want = f(x, w, b, rm.clone(), rv.clone())[0]
    assert want[:, 1:3].isnan().any()  # the case the test is about


def test_batch_norm_statistics_in_compiled_code_are_eagers(tiered, no_trial):
    # Eager's CPU kernel takes the mean as a sum over the count: an infinite
    # element makes the mean and the running mean infinite. The
    # decomposition's one-pass statistics gave NaN (difffuzz seed 3924393).
    def f(x, w, b, rm, rv):
        out, = torch.nn.functional.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1),
        return out * 1.0, rm + 0, rv + 0

    g = torch.Generator().manual_seed(7)
    x = 2 / torch.tensor([[[[-1.25, -0.37, 0.0, -1.8]]]])  # one channel, an infinite element
    w, b = torch.randn(1, generator=g), torch.randn(1, generator=g)
    rm, rv = torch.randn(1, generator=g), torch.rand(1, generator=g) + 0.5
    tiers = run_hot(lambda *t: f(t[0], t[1], t[2], t[3].clone(), t[4].clone()), [x, w, b, rm, rv])
    assert tiers[-1] == 1, torch_mgpu._C._tier_last_error()
    want = f(x, w, b, rm.clone(), rv.clone())[1]
    assert torch.isinf(want[0])  # the case the test is about


def test_min_over_a_dim_of_a_bool_tensor_in_compiled_code(tiered, no_trial):
    # Inductor's code for min.dim of a bool tensor gave the index of the
    # first True (difffuzz seed 3924806: [True, False].min(0) gave index 0).
    def f(x, y):
        v, i = x.min(0)
        w, j = x.max(-1)
        return v, i, w, j, y * 2

    x = torch.tensor([True, False, True, False])
    tiers = run_hot(f, [x, torch.randn(3)], exact=True)
    assert tiers[-1] == 1, torch_mgpu._C._tier_last_error()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_zero_nll_loss_in_compiled_code_has_eagers_sign(tiered, no_trial, reduction):
    # Eager's CPU kernel accumulates a reduced loss as 0 - x * w: +0.0 where
    # the decomposition's -(x * w) is -0.0, and a mean divides that by the
    # total weight. cross_entropy over one class is such a zero (difffuzz
    # seed 3927966: a `//` by it gave -inf where eager gives +inf).
    def f(x, x1, w, t, t1):
        losses = (torch.nn.functional.cross_entropy(x, t, reduction=reduction),
                  torch.nn.functional.nll_loss(x, t, weight=w, reduction=reduction),
                  torch.nn.functional.nll_loss(x1, t1, reduction=reduction),
                  torch.nn.functional.nll_loss(x1, t1, weight=w, reduction=reduction))
        return tuple(1 / loss for loss in losses)  # the zero's sign as +-inf

    x = torch.randn(3, 1) * 0  # one class: log_softmax gives 0
    x1 = torch.zeros(1)
    w = torch.tensor([-2.5])
    t = torch.zeros(3, dtype=torch.long)
    t1 = torch.tensor(0)
    tiers = run_hot(f, [x, x1, w, t, t1])
    assert tiers[-1] == 1, torch_mgpu._C._tier_last_error()
    assert torch.isinf(f(x, x1, w, t, t1)[0]).all()  # the case the test is about


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_of_inf_in_compiled_code_is_eagers(tiered, no_trial, dtype):
    # Eager's CPU gelu of a contiguous float32 or bfloat16 tensor of two or
    # more elements (its vectorized path) gives NaN for +inf on an AVX-512
    # CPU, +inf on an AVX2 one; its scalar path (one element, a strided
    # tensor) gives +inf, as inductor's code does (difffuzz seed 3936822: a
    # cumsum reaching +inf, then gelu). -inf gives NaN.
    def f(x, y):
        big = torch.nn.functional.gelu(x * 1.0)
        one = torch.nn.functional.gelu(x[2:3] * 1.0)
        strided = torch.nn.functional.gelu((x * 1.0)[::2])
        inplace = y * 1.0
        torch.ops.aten.gelu_(inplace)
        return big, one, strided, inplace

    x = torch.tensor([0.47, -0.08, float("inf"), 1.5, -float("inf"), 2.0]).to(dtype)
    y = torch.tensor([[float("inf"), 0.3], [0.25, -1.0]]).to(dtype)
    tiers = run_hot(f, [x, y])
    assert tiers[-1] == 1, torch_mgpu._C._tier_last_error()
    big, one, strided, inplace = f(x, y)
    assert one[0].isinf() and strided[2].isnan()  # the scalar path's cases
    # The vectorized path's, whichever this CPU gives (the next test takes
    # the other): what the probe found.
    from torch_mgpu._tiers import numerics

    at_pos, at_neg = numerics._eager_gelu_of_infinities(dtype)
    assert numerics._same_number(big[2].item(), at_pos) and numerics._same_number(big[4].item(), at_neg)
    assert numerics._same_number(inplace[0, 0].item(), at_pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_of_infinities_in_compiled_code_is_what_eagers_vector_path_gives(tiered, no_trial, dtype, monkeypatch):
    # Eager's vectorized gelu at +inf and -inf differs between CPUs (see the
    # test above): compiled code gives what it gives on this one, here a
    # stand-in CPU's (NaN at +inf, -7 at -inf, so that both are seen).
    from torch_mgpu._tiers import numerics

    monkeypatch.setattr(numerics, "_eager_gelu_of_infinities", lambda dt: (float("nan"), -7.0))
    x = torch.tensor([0.47, float("inf"), -0.08, 1.5, -float("inf"), 2.0, 0.1]).to(dtype)
    want = torch.nn.functional.gelu(x)
    want[1], want[4] = float("nan"), -7.0
    f = lambda t: torch.nn.functional.gelu(t * 1.0)  # noqa: E731
    xm = x.to("mgpu")
    tiers = []
    for k in range(4):
        torch.testing.assert_close(f(xm).cpu(), want if k >= 2 else f(x), equal_nan=True)
        tiers.append(torch_mgpu.last_plan().tier)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert tiers == [0, 0, 1, 1], (tiers, torch_mgpu._C._tier_last_error())


def test_gelu_is_rewritten_at_the_infinities_on_host_lanes_only(tiered, no_trial, monkeypatch):
    # The probe reads the host CPU's vectorized kernel; CUDA's gelu computes
    # the formula inductor compiles: the same graph's request, for CUDA
    # lanes, keeps inductor's gelu (here with a stand-in CPU whose values
    # differ, so that host lanes rewrite it).
    from torch_mgpu._tiers import numerics, replay

    monkeypatch.setattr(numerics, "_eager_gelu_of_infinities", lambda dt: (float("nan"), -7.0))
    requests = []
    real = replay._Graph

    def spy(req, subst):
        requests.append(req)
        return real(req, subst)

    monkeypatch.setattr(replay, "_Graph", spy)
    x = torch.tensor([0.47, float("inf"), -0.08, 1.5, -float("inf"), 2.0, 0.1, 0.3, -1.25]).to("mgpu")
    for k in range(3):
        torch.nn.functional.gelu(x * 1.5).cpu()
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    gelu = [r for r in requests if any(n["op"] == "aten::gelu" for n in r["nodes"])]
    assert gelu, "the graph was not compiled"
    req = gelu[0]
    at = next(i for i, n in enumerate(req["nodes"]) if n["op"] == "aten::gelu")
    assert at in real(dict(req, device="cpu"), {}).formulas
    assert at not in real(dict(req, device="cuda"), {}).formulas
