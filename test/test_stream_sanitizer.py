"""The stream-order sanitizer (csrc/runtime/sanitizer.h): CPU lanes run as
stream lanes, every access the executor queues on a stream is checked with
vector clocks over events, waits and synchronizes, and the allocator's frees
over recordDataPtrOnStream. What a GPU would need (no two streams touching a
buffer unordered, no block reused while a stream may use it) is checked here
on every workload below; dropping one event or one record must be caught."""
import os
import random
import re
import sys

import pytest
import torch

import torch_mgpu
from conftest import async_ops, random_dag_program, restore_lanes, run_hot
from test_parallel import check_random_dag

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_branches  # noqa: E402
import bench_data_parallel  # noqa: E402
import bench_inception  # noqa: E402
import bench_kernels  # noqa: E402
import bench_matmul_loop  # noqa: E402
from common import tree_map  # noqa: E402

C = torch_mgpu._C


# Tier 0 (nodes on the lanes' streams), whatever the default; tests of
# compiled parts turn tier 1 on themselves (`compiled_parts`).
pytestmark = pytest.mark.usefixtures("node_by_node")


@pytest.fixture
def sanitized():
    """Runs the test under the sanitizer; any race fails it."""
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    streams()  # CPU lanes (a machine with a GPU starts on CUDA lanes, which the sanitizer refuses)
    C._stream_sanitizer_start()
    try:
        yield
        torch_mgpu.synchronize()
        checked = C._stream_sanitizer_accesses()
    finally:
        races = C._stream_sanitizer_stop()
        restore_lanes(*before)
    assert races == [], "\n".join(races[:10])
    assert checked > 0, "nothing ran on a stream lane"


def streams(devices=("cpu", "cpu"), lanes=2, policy="heft"):
    torch_mgpu.configure(devices=list(devices), lanes_per_device=lanes, policy=policy)


def fusible_chain(x):
    return ((x + 1.0) * 2.0 - 3.0) / 4.0


def test_what_keeps_a_graph_from_replay_is_known_before_it_runs():
    # A plan is captured and replayed only where every lane it uses is a
    # stream lane (CPU stream lanes stand in for a GPU's) and no op draws
    # from a seeded generator; _replay_blocker says why not, running nothing.
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    x = torch.randn(64, 64)
    streams(["cpu"], 2)
    try:
        xm = x.to("mgpu")
        ys = [torch.tanh(xm @ xm * k) for k in range(4)]
        assert "is a host lane (cpu): only stream lanes are captured" in C._replay_blocker()
        assert torch_mgpu.pending_ops() > 0  # nothing ran
        torch.testing.assert_close(ys[3].cpu(), torch.tanh(x @ x * 3))
        C._stream_sanitizer_start()
        try:
            xm = x.to("mgpu")
            ys = [torch.tanh(xm @ xm * k) for k in range(4)]
            assert C._replay_blocker() is None
            d = torch.nn.functional.dropout(ys[1], 0.5)
            why = C._replay_blocker()
            assert "aten::native_dropout" in why and "draws random numbers" in why, why
            torch.testing.assert_close(ys[2].cpu(), torch.tanh(x @ x * 2))
            assert d.cpu().shape == (64, 64)
            assert C._replay_blocker() == "no op to run"
        finally:
            races = C._stream_sanitizer_stop()
        assert races == []
    finally:
        restore_lanes(*before)


def test_lanes_become_stream_lanes_and_back():
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    x = torch.randn(64, 64)
    streams(["cpu"], 3)
    torch.testing.assert_close(fusible_chain(x.to("mgpu")).cpu(), fusible_chain(x))
    assert torch_mgpu.last_plan().fused_nodes > 0  # host lanes fuse
    C._stream_sanitizer_start()
    try:
        xm = x.to("mgpu")
        ys = [torch.tanh(xm @ xm + i) for i in range(6)]
        for i, y in enumerate(ys):
            torch.testing.assert_close(y.cpu(), torch.tanh(x @ x + i))
        assert torch_mgpu.last_plan().lanes_used > 1
        checked = C._stream_sanitizer_accesses()
        assert checked >= 6 * 3
        # Stream lanes run every node alone: no fused host kernels.
        torch.testing.assert_close(fusible_chain(x.to("mgpu")).cpu(), fusible_chain(x))
        assert torch_mgpu.last_plan().fused_nodes == 0
        assert C._stream_sanitizer_accesses() > checked
    finally:
        races = C._stream_sanitizer_stop()
    try:
        assert races == []
        assert torch_mgpu.lanes() == [f"cpu:0/lane{k}" for k in range(3)]
        # Host lanes again: fused.
        torch.testing.assert_close(fusible_chain(x.to("mgpu")).cpu(), fusible_chain(x))
        assert torch_mgpu.last_plan().fused_nodes > 0
        # A CUDA-style stream on the CPU device is PyTorch's own again.
        with pytest.raises(RuntimeError):
            torch.Event(device="cpu").record()
    finally:
        restore_lanes(*before)


def test_a_second_start_is_refused():
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    streams()
    C._stream_sanitizer_start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            C._stream_sanitizer_start()
    finally:
        assert C._stream_sanitizer_stop() == []
        restore_lanes(*before)


@pytest.mark.parametrize("seed", range(10))
def test_random_dags(sanitized, seed):
    check_random_dag(random.Random(500 + seed), seed, lanes=[1, 2, 3], n_ops=(10, 60))


@pytest.mark.parametrize("seed", range(4))
def test_random_dags_with_background_flights(sanitized, seed):
    with async_ops(random.Random(seed).choice([4, 8, 16])):
        check_random_dag(random.Random(900 + seed), seed, lanes=[2, 3], n_ops=(30, 80))


SEEDS = [c for mod in (bench_matmul_loop, bench_branches, bench_data_parallel, bench_kernels, bench_inception)
         for c in mod.cases(True)]


@pytest.mark.parametrize("case", SEEDS, ids=[c.name for c in SEEDS])
def test_seed_workloads(sanitized, case):
    streams(["cpu", "cpu"], 2)
    expected = case.fn(*case.make("cpu"))
    got = case.fn(*case.make("mgpu"))
    flat_e, flat_g = [], []
    tree_map(flat_e.append, expected)
    tree_map(flat_g.append, got)
    assert len(flat_e) == len(flat_g)
    for e, g in zip(flat_e, flat_g):
        torch.testing.assert_close(g.cpu(), e, rtol=1e-4, atol=1e-4)


def test_autograd_training_steps(sanitized):
    streams(["cpu"], 3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    twin.load_state_dict(model.state_dict())
    twin = twin.to("mgpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(twin.parameters(), lr=0.1)
    for step in range(3):
        xs = [torch.randn(8, 16) for _ in range(4)]
        loss = sum(model(x).pow(2).mean() for x in xs)
        loss_m = sum(twin(x.to("mgpu")).pow(2).mean() for x in xs)
        opt.zero_grad()
        opt_m.zero_grad()
        loss.backward()
        loss_m.backward()
        opt.step()
        opt_m.step()
        torch.testing.assert_close(loss_m.cpu(), loss, rtol=1e-5, atol=1e-6)
    for p, pm in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(pm.cpu(), p, rtol=1e-5, atol=1e-6)


def in_place_and_views(xs):
    a, b, c = (x.clone() for x in xs)
    a[2:6].mul_(0.5)
    b.t_()
    b.add_(a)
    v = c.view(4, 64)[1:3]
    v.sub_(1.0)
    d = torch.cat([a[:, :8], b[:, 8:]], 1)
    d.index_add_(0, torch.tensor([0, 3, 5]).to(d.device), a[:3] * 2)
    e = c.transpose(0, 1).reshape(-1)[::3]
    c.tanh_()
    f = (d @ c.t()).relu_()
    a.copy_(f)
    return [a, b, c, d, e.clone(), f]


def test_in_place_and_view_heavy_graphs(sanitized):
    streams(["cpu"], 3)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, 16, generator=g) for _ in range(3)]
    expected = in_place_and_views(xs)
    got = in_place_and_views([x.to("mgpu") for x in xs])
    for e, m in zip(expected, got):
        torch.testing.assert_close(m.cpu(), e)


def test_virtual_devices_of_streams(sanitized):
    # Four virtual devices of two streams each: values cross devices as copies.
    streams(["cpu"] * 4, 2)
    for seed in range(3):
        rng = random.Random(700 + seed)
        program = random_dag_program(rng, 4, 60)
        g = torch.Generator().manual_seed(seed)
        inputs = [torch.randn(16, 16, generator=g) for _ in range(4)]
        before = torch_mgpu.stats()["bytes_transferred"]
        expected = program(inputs)
        got = program([t.to("mgpu") for t in inputs])
        for e, m in zip(expected, got):
            torch.testing.assert_close(m.cpu(), e)
        assert torch_mgpu.stats()["bytes_transferred"] > before


def branchy(xs):
    ys = [torch.tanh(x @ x).sum(0) + i for i, x in enumerate(xs)]
    return sum(ys)


@pytest.mark.parametrize("point", ["drop_event_wait", "drop_record_use"])
def test_a_dropped_event_or_record_is_reported(point):
    # The sanitizer can fail: leave out one cross-lane event wait (or one
    # allocator record) and a race is reported, naming the nodes.
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    streams(["cpu"], 3)
    C._stream_sanitizer_start()
    try:
        xs = [torch.randn(64, 64, generator=torch.Generator().manual_seed(k)) for k in range(6)]
        expected = branchy(xs)
        torch.testing.assert_close(branchy([x.to("mgpu") for x in xs]).cpu(), expected)
        assert C._stream_sanitizer_races() == []
        # Leave out the k-th one of a run, for each k until one is caught
        # (not every one matters: a wait or a record on the producer's own
        # stream, or for a value that outlives the run, orders nothing).
        caught, runs = [], 0
        for k in range(1, 80):
            fired = C._faults_fired(point)
            C._inject_fault(point, k)
            try:
                got = branchy([x.to("mgpu") for x in xs]).cpu()
            finally:
                C._inject_fault(point, 0)
            if C._faults_fired(point) == fired:
                break  # a run has fewer
            runs += 1
            torch.testing.assert_close(got, expected)  # the host kernels are right whatever the order
            caught += C._stream_sanitizer_races()
            if caught:
                break
        assert runs > 0
    finally:
        C._stream_sanitizer_stop()
        restore_lanes(*before)
    assert caught, f"no race reported with {point}"
    for race in caught:
        assert race.startswith("stream-order race on buffer") and "node " in race, race
    if point == "drop_record_use":
        assert any("its free" in race for race in caught), caught


def test_off_outside_the_fixture():
    # Without the sanitizer, CPU lanes are host lanes and nothing is checked.
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="heft")
    fired = C._faults_fired("drop_event_wait")
    C._inject_fault("drop_event_wait", 1)
    try:
        xs = [torch.randn(8, 8) for _ in range(4)]
        torch.testing.assert_close(branchy([x.to("mgpu") for x in xs]).cpu(), branchy(xs))
        assert torch_mgpu.last_plan().lanes_used == 2
    finally:
        C._inject_fault("drop_event_wait", 0)
        restore_lanes(*before)
    assert C._faults_fired("drop_event_wait") == fired  # host lanes wait for no events


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA lanes")
def test_refused_on_cuda_lanes():
    # A GPU's own events and waits go to its backend, unseen by the sanitizer.
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(devices=["cuda:0"], lanes_per_device=2)
    try:
        with pytest.raises(RuntimeError, match="checks CPU lanes"):
            C._stream_sanitizer_start()
    finally:
        restore_lanes(*before)


def towers(a, b, c, d):
    # Two independent products, each worth a lane, and a join. (A part
    # costs a call: at 320 x 320 a 16-core machine's lanes ran each product
    # fast enough that the split was not worth it, and tier 1 compiled the
    # graph whole.)
    left = torch.tanh(a @ b) * 0.5
    right = torch.relu(c @ d) + 0.25
    return left + right, right.mean()


@pytest.fixture
def compiled_parts():
    """Tier 1 on (compile after two runs, kept without a trial) with one
    graph per sync."""
    saved, hits = torch_mgpu.async_ops(), C._tier_compile_hits()
    torch_mgpu.set_async_ops(0)
    torch_mgpu.configure(compile=2)
    C._set_tier_trial(False)
    yield
    torch_mgpu.wait_for_compiles(120)
    C._set_tier_trial(True)
    torch_mgpu.configure(compile=hits)
    torch_mgpu.set_async_ops(saved)


def test_compiled_parts_run_on_the_stream_lanes_in_stream_order(sanitized, compiled_parts):
    # Tier 1 on stream lanes (a GPU's, here CPU lanes under the sanitizer):
    # each part queued on its lane's stream after the events of the parts
    # it reads, its inputs recorded on that stream; no race.
    xs = [torch.randn(512, 512, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    tiers = run_hot(towers, xs)
    assert tiers == [0, 0, 1, 1], C._tier_last_error()
    plan = torch_mgpu.last_plan()
    assert "parts on 2 lanes" in plan.compiled, plan.compiled
    mg = [x.to("mgpu") for x in xs]
    torch_mgpu.synchronize()
    checked = C._stream_sanitizer_accesses()
    for w, t in zip(towers(*xs), towers(*mg)):
        torch.testing.assert_close(t.cpu(), w, rtol=1e-4, atol=1e-4)
    assert torch_mgpu.last_plan().tier == 1
    assert C._stream_sanitizer_accesses() > checked  # the compiled parts' work, on the streams
    # A graph without branches compiles whole: it runs on the first lane's stream.
    x = torch.randn(48, 48)
    want = fusible_chain(torch.tanh(fusible_chain(x)))
    for k in range(4):
        xm = x.to("mgpu")
        torch_mgpu.synchronize()
        checked = C._stream_sanitizer_accesses()
        torch.testing.assert_close(fusible_chain(torch.tanh(fusible_chain(xm))).cpu(), want)
        if k == 1:
            assert torch_mgpu.wait_for_compiles(300)
    assert torch_mgpu.last_plan().tier == 1 and " parts " not in torch_mgpu.last_plan().compiled
    assert C._stream_sanitizer_accesses() > checked  # the compiled graph's work, on a stream


def test_a_dropped_event_between_compiled_parts_is_reported(compiled_parts):
    # The join's part reads the other lane's part: leave out its event wait
    # and the sanitizer names the compiled parts. (No block a part reads is
    # freed before every lane's stream has finished: no record on a stream
    # to leave out.)
    point = "drop_event_wait"
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    streams(["cpu"], 2)
    C._stream_sanitizer_start()
    try:
        xs = [torch.randn(520, 520, generator=torch.Generator().manual_seed(k)) for k in range(4)]
        assert run_hot(towers, xs) == [0, 0, 1, 1], C._tier_last_error()
        assert C._stream_sanitizer_races() == []
        want = towers(*xs)
        caught = []
        for k in range(1, 8):
            fired = C._faults_fired(point)
            C._inject_fault(point, k)
            try:
                got = towers(*[x.to("mgpu") for x in xs])
                got = [t.cpu() for t in got]
            finally:
                C._inject_fault(point, 0)
            assert torch_mgpu.last_plan().tier == 1
            if C._faults_fired(point) == fired:
                break  # a run has fewer
            for w, t in zip(want, got):
                torch.testing.assert_close(t, w, rtol=1e-4, atol=1e-4)
            caught += C._stream_sanitizer_races()
            if caught:
                break
    finally:
        C._stream_sanitizer_stop()
        restore_lanes(*before)
    assert caught, f"no race reported with {point}"
    assert all("compiled part" in race for race in caught), caught


@pytest.fixture
def replaying():
    """Replay of hot graphs on (after 2 syncs), one graph per sync, with
    no trial: every run after the recorded one replays."""
    hits, trial = C._replay_hits(), C._replay_trial()
    C._set_replay_hits(2)
    C._set_replay_trial(False)
    try:
        with async_ops(0):
            yield
    finally:
        C._set_replay_hits(hits)
        C._set_replay_trial(trial)


def replay_step(x, w, b):
    # Branches joined by a sum, an in-place write into an input, a view.
    heads = [torch.tanh(x @ w * k) for k in (1.0, 2.0, 3.0)]
    total = heads[0] + heads[1] + heads[2]
    b.mul_(0.5).add_(total.sum(0))
    return total, total.t()[1:4], b


def test_a_hot_graph_on_stream_lanes_replays_with_eager_results(sanitized, replaying):
    # Runs 1-2 are counted, run 3 is recorded (tier 0), later runs copy new
    # inputs into the recording's own bytes and replay it (tier 2): eager's
    # values every step, the in-place write landing in the caller's tensor,
    # results of earlier steps kept as they were, and no race.
    streams(["cpu"], 3)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 24, generator=gen)
    b_cpu = torch.randn(24, generator=gen)
    b = b_cpu.to("mgpu")
    runs0 = torch_mgpu.stats()["replay_runs"]
    tiers, replays, kept = [], [], []
    for step in range(6):
        x = torch.randn(24, 24, generator=gen)
        want = replay_step(x, w, b_cpu)
        got = replay_step(x.to("mgpu"), w.to("mgpu"), b)
        for g, e in zip(got, want):
            torch.testing.assert_close(g.cpu(), e)
        plan = torch_mgpu.last_plan()
        tiers.append(plan.tier)
        replays.append(plan.replay)
        kept.append((got[0], want[0].clone()))
    assert tiers == [0, 0, 0, 2, 2, 2], (tiers, replays)
    assert replays[2].startswith("recorded for replay"), replays
    assert replays[3].startswith("replayed its recording"), replays
    assert "tier 2: replayed" in str(plan)
    assert torch_mgpu.stats()["replay_runs"] - runs0 == 3
    assert torch_mgpu.stats()["replay_pool_bytes"] > 0
    for got, want in kept:  # no replay wrote what an earlier one returned
        torch.testing.assert_close(got.cpu(), want)


def test_a_replay_copies_only_the_inputs_whose_values_changed(sanitized, replaying):
    # A leaf that is the very value the last replay copied (a weight kept
    # on mgpu) is not copied again; a new value (a fresh input, the weight
    # written in place), or bytes the graph writes (b, updated in place),
    # are copied every time. Eager's values throughout.
    streams(["cpu"], 3)
    gen = torch.Generator().manual_seed(9)
    w_cpu = torch.randn(24, 24, generator=gen)
    w = w_cpu.to("mgpu")
    b_cpu = torch.randn(24, generator=gen)
    b = b_cpu.to("mgpu")
    copied = []
    for step in range(8):
        if step == 5:  # the weight takes a new value between steps
            w_cpu.mul_(0.5)
            w.mul_(0.5)
            torch_mgpu.synchronize()
        x = torch.randn(24, 24, generator=gen)
        want = replay_step(x, w_cpu, b_cpu)
        got = replay_step(x.to("mgpu"), w, b)
        for g, e in zip(got, want):
            torch.testing.assert_close(g.cpu(), e)
        m = re.search(r"(\d+) of (\d+) inputs copied", torch_mgpu.last_plan().replay)
        copied.append(m and (int(m.group(1)), int(m.group(2))))
    assert copied[:3] == [None, None, None], copied  # counted, counted, recorded
    assert copied[3:] == [(3, 3), (2, 3), (3, 3), (2, 3), (2, 3)], copied


def test_a_check_left_to_a_replays_end_raises_as_eager_does(sanitized, replaying):
    # linalg.cholesky and linalg.inv check their results on the host (on a
    # GPU a sync, which a CUDA graph cannot hold): replays run their
    # unchecked forms and read the error codes once done. A matrix that
    # fails at a replay raises eager's error at the sync (the graph run
    # anew), and the graph goes on with eager's values.
    streams(["cpu"], 2)
    gen = torch.Generator().manual_seed(11)

    def heads(a, b):
        return torch.linalg.cholesky(a) * 2, torch.linalg.inv(b) + 1

    def spd():
        m = torch.randn(8, 8, generator=gen)
        return m @ m.t() + 8 * torch.eye(8)

    dropped = torch_mgpu.stats()["replay_dropped"]
    tiers = []
    for _ in range(6):
        a, b = spd(), spd()
        for g, e in zip(heads(a.to("mgpu"), b.to("mgpu")), heads(a, b)):
            torch.testing.assert_close(g.cpu(), e)
        tiers.append(torch_mgpu.last_plan().tier)
    assert tiers == [0, 0, 0, 2, 2, 2], tiers
    bad = spd()
    bad[3, 3] = -1.0  # a leading minor that is not positive-definite
    with pytest.raises(torch.linalg.LinAlgError) as eager:
        torch.linalg.cholesky(bad)
    got = heads(bad.to("mgpu"), spd().to("mgpu"))
    with pytest.raises(torch.linalg.LinAlgError) as lazy:
        got[0].cpu()
    assert str(lazy.value).startswith(str(eager.value)), (lazy.value, eager.value)
    assert torch_mgpu.stats()["replay_dropped"] == dropped + 1
    for _ in range(5):
        a, b = spd(), spd()
        for g, e in zip(heads(a.to("mgpu"), b.to("mgpu")), heads(a, b)):
            torch.testing.assert_close(g.cpu(), e)
    assert torch_mgpu.last_plan().tier == 2, torch_mgpu.last_plan().replay


def test_a_recorded_graph_replays_on_trial_and_keeps_the_faster_way(sanitized, replaying):
    # With the trial on, replay and the run without it (tier 0 here) take
    # turns after the recording, 3 timed runs each; then the faster stays
    # (which one follows this machine's speed: both outcomes are checked
    # for what holds either way, C++'s Replay.ItsTrial... pins each).
    C._set_replay_trial(True)
    streams(["cpu"], 3)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(20, 20, generator=gen)
    b_cpu = torch.randn(20, generator=gen)
    b = b_cpu.to("mgpu")
    rejected = torch_mgpu.stats()["replay_rejected"]
    plans = []
    for step in range(14):
        x = torch.randn(20, 20, generator=gen)
        want = replay_step(x, w, b_cpu)
        got = replay_step(x.to("mgpu"), w.to("mgpu"), b)
        for g, e in zip(got, want):
            torch.testing.assert_close(g.cpu(), e)
        plan = torch_mgpu.last_plan()
        plans.append((plan.tier, plan.replay))
    tiers = [t for t, _ in plans]
    assert tiers[:3] == [0, 0, 0] and plans[2][1].startswith("recorded for replay"), plans
    on_trial = plans[3:10]
    assert sum(t == 2 for t, _ in on_trial) == 4, plans  # replay's cold run and 3 timed
    assert all("on trial" in r for t, r in on_trial if t == 0), plans
    kept = "kept after its trial" in plans[-1][1]
    if kept:
        assert tiers[10:] == [2] * 4, plans
        assert torch_mgpu.stats()["replay_rejected"] == rejected
    else:
        assert tiers[10:] == [0] * 4, plans
        assert "slower than its run without replay in its trial" in plans[-1][1], plans
        assert torch_mgpu.stats()["replay_rejected"] == rejected + 1


def test_what_cannot_be_replayed_says_why_and_runs_as_before(sanitized, replaying):
    streams(["cpu"], 2)
    x = torch.randn(16, 16)
    for _ in range(4):
        xm = x.to("mgpu")
        y = torch.nn.functional.dropout(torch.tanh(xm @ xm), 0.5) + xm
        assert y.cpu().shape == (16, 16)
    plan = torch_mgpu.last_plan()
    assert plan.tier == 0
    assert "not replayed" in plan.replay and "draws random numbers" in plan.replay, plan.replay
    # A random op of the graph (its generator seeded at the call): each
    # step draws new numbers.
    draws = []
    for step in range(5):
        xm = x.to("mgpu")
        draws.append((torch.tanh(xm @ xm) + torch.randn(16, 16, device="mgpu")).cpu())
    plan = torch_mgpu.last_plan()
    assert plan.tier == 0 and "a generator seeded at its call" in plan.replay, plan.replay
    assert not torch.equal(draws[3], draws[4])


def test_a_replay_that_fails_drops_its_recording_and_the_graph_runs_anew(sanitized, replaying):
    # A kernel failing in a replay (an injected fault): the other lanes stop
    # and finish what they queued, the recording is dropped, and tier 0 runs
    # the graph: eager's values, the in-place write made once. Then the
    # graph records again once hot again.
    streams(["cpu"], 3)
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(24, 24, generator=gen)
    b_cpu = torch.randn(24, generator=gen)
    b = b_cpu.to("mgpu")
    stats = torch_mgpu.stats

    def step():
        x = torch.randn(24, 24, generator=gen)
        want = replay_step(x, w, b_cpu)
        got = replay_step(x.to("mgpu"), w.to("mgpu"), b)
        for g, e in zip(got, want):
            torch.testing.assert_close(g.cpu(), e)
        return torch_mgpu.last_plan()

    assert [step().tier for _ in range(4)] == [0, 0, 0, 2]
    dropped = stats()["replay_dropped"]
    C._inject_fault("node", 4)
    try:
        plan = step()
    finally:
        C._inject_fault("node", 0)
    assert plan.tier == 0 and "its replay failed" in plan.replay, plan.replay
    assert stats()["replay_dropped"] == dropped + 1
    assert [step().tier for _ in range(4)] == [0, 0, 0, 2]


def test_new_input_sizes_record_again(sanitized, replaying):
    streams(["cpu"], 2)
    tiers = []
    for n in (8, 8, 8, 8, 12, 12, 12, 12):
        x = torch.randn(n, n)
        xm = x.to("mgpu")
        got = (torch.tanh(xm @ xm) + torch.sigmoid(xm * 2)).cpu()
        torch.testing.assert_close(got, torch.tanh(x @ x) + torch.sigmoid(x * 2))
        tiers.append(torch_mgpu.last_plan().tier)
    assert tiers == [0, 0, 0, 2, 0, 0, 0, 2], tiers


def test_recordings_past_the_bound_drop_the_least_recently_used(sanitized, replaying):
    streams(["cpu"], 2)

    def hot(n, runs=4):
        tiers = []
        for _ in range(runs):
            x = torch.randn(n, n)
            xm = x.to("mgpu")
            torch.testing.assert_close((torch.tanh(xm @ xm) + xm * 2).cpu(), torch.tanh(x @ x) + x * 2)
            tiers.append(torch_mgpu.last_plan().tier)
        return tiers

    limit = C._replay_pool_limit()
    stats = torch_mgpu.stats
    try:
        for bound in [(limit[0], 1), (1, limit[1])]:  # one recording; one byte (the newest stays)
            C._set_replay_pool_limit(*bound)
            evicted = stats()["replay_evicted"]
            assert hot(8) == [0, 0, 0, 2]
            assert stats()["replay_recordings"] == 1
            assert hot(12) == [0, 0, 0, 2]  # its recording drops the first graph's
            assert stats()["replay_recordings"] == 1 and stats()["replay_evicted"] == evicted + 1
            assert hot(12, 1) == [2]
            assert hot(8) == [0, 0, 0, 2], "recorded again once hot again"
            assert stats()["replay_evicted"] == evicted + 2
        C._set_replay_pool_limit(*limit)
        assert hot(12) == [0, 0, 0, 2]
        assert hot(8, 1) == [2]  # both kept under the default bound
        assert stats()["replay_recordings"] == 2
    finally:
        C._set_replay_pool_limit(*limit)


def test_replay_is_off_by_default():
    assert C._replay_hits() == 0
