"""Partitioning over lanes: plans, parallel execution, virtual devices, the
plan cache, the simulator, and correctness under concurrency."""
import copy
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_mgpu
from conftest import async_ops, random_dag_program

# What nodes do on the lanes: tier 0, whatever the default (conftest).
pytestmark = pytest.mark.usefixtures("node_by_node")


@pytest.fixture
def lanes_config():
    """Restores the default lane configuration after a test."""
    saved = torch_mgpu.configuration()
    yield
    torch_mgpu.configure(**saved)


def branches(n=8, size=128, seed=0, device="mgpu"):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(size, size, generator=g) for _ in range(n)]
    return xs, [x.to(device) for x in xs]


def branchy(xs):
    return sum(torch.tanh(x @ x).mul(0.5).add(1.0) for x in xs)


def test_configure_and_lanes(lanes_config):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=3)
    assert torch_mgpu.lanes() == ["cpu:0/lane0", "cpu:0/lane1", "cpu:0/lane2"]
    torch_mgpu.configure(devices=["cpu", "cpu"], lanes_per_device=1)
    assert torch_mgpu.lanes() == ["cpu:0/lane0", "cpu:1/lane0"]
    torch_mgpu.configure(policy="heft")
    assert torch_mgpu.policy() == "heft" and len(torch_mgpu.lanes()) == 2
    with pytest.raises(RuntimeError, match="unknown policy"):
        torch_mgpu.configure(policy="fastest")
    with pytest.raises(RuntimeError, match="unknown device"):
        torch_mgpu.configure(devices=["tpu"])
    with pytest.raises(ValueError, match="lanes_per_device"):
        torch_mgpu.configure(lanes_per_device=0)
    with pytest.raises(RuntimeError, match="unknown device 'cuda'"):
        torch_mgpu.configure(devices=["cuda"])  # a device index is needed
    before = torch_mgpu.lanes()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA lanes need a CUDA device"):
            torch_mgpu.configure(devices=["cuda:0"])
    else:
        with pytest.raises(RuntimeError, match="does not exist"):
            torch_mgpu.configure(devices=[f"cuda:{torch.cuda.device_count()}"])
    assert torch_mgpu.lanes() == before  # a refused configuration changes nothing


def test_configuration_gives_configure_its_arguments_back(lanes_config):
    torch_mgpu.configure(devices=["cpu", "cpu", "cpu"], lanes_per_device=2, policy="heft")
    saved = torch_mgpu.configuration()
    assert saved == {"devices": ["cpu", "cpu", "cpu"], "lanes_per_device": 2, "policy": "heft"}
    lanes = torch_mgpu.lanes()
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=1, policy="serial")
    assert torch_mgpu.configuration() == {"devices": ["cpu"], "lanes_per_device": 1, "policy": "serial"}
    torch_mgpu.configure(**saved)
    assert torch_mgpu.lanes() == lanes and torch_mgpu.policy() == "heft"
    if torch.cuda.is_available():
        torch_mgpu.configure(devices=["cuda:0"], lanes_per_device=2, policy="auto")
        assert torch_mgpu.configuration() == {"devices": ["cuda:0"], "lanes_per_device": 2, "policy": "auto"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_lanes_match_eager(lanes_config):
    torch_mgpu.configure(devices=[f"cuda:{k}" for k in range(torch.cuda.device_count())], lanes_per_device=2)
    assert torch_mgpu.lanes()[0] == "cuda:0/stream0"
    torch.manual_seed(0)
    xs = [torch.randn(96, 96) for _ in range(6)]
    ref = branchy(xs)
    got = branchy([x.to("mgpu") for x in xs]).cpu()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    plan = torch_mgpu.last_plan()
    assert plan.lanes_used >= 2


def test_environment_configures_lanes():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import torch_mgpu; print(torch_mgpu.lanes(), torch_mgpu.policy())"],
                         env={**__import__("os").environ, "TORCH_MGPU_DEVICES": "cpu,cpu", "TORCH_MGPU_LANES": "2",
                              "TORCH_MGPU_POLICY": "heft"},
                         capture_output=True, text=True, check=True).stdout
    assert "cpu:1/lane1" in out and "heft" in out


@pytest.mark.parametrize("policy", ["heft", "auto"])
def test_independent_branches_run_on_several_lanes_at_once(lanes_config, policy):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy=policy)
    xs, ms = branches(size=160)
    expected = branchy(xs)
    for _ in range(3):  # the first run may still be calibrating caches
        got = branchy(ms).cpu()
    torch.testing.assert_close(got, expected)
    plan = torch_mgpu.last_plan()
    if policy == "heft":
        assert plan.lanes_used == 2
        assert len(plan.busy_lanes()) == 2
    assert plan.predicted_makespan > 0 and plan.measured_makespan > 0
    for e in plan.timeline():
        assert e["end"] >= e["start"] >= 0
        assert e["predicted_end"] >= e["predicted_start"] >= 0


def test_parallel_lanes_overlap_in_time(lanes_config):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="heft")
    xs, ms = branches(n=8, size=320)  # milliseconds per lane: far above a wake-up
    best = 0
    for _ in range(10):
        branchy(ms).cpu()
        best = max(best, torch_mgpu.last_plan().max_concurrency())
        if best >= 2:
            break
    assert best >= 2


def test_chain_runs_on_one_lane(lanes_config):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="auto")
    x = torch.randn(64, device="mgpu")
    for _ in range(200):
        x = x * 1.001 + 0.001
    x.cpu()
    plan = torch_mgpu.last_plan()
    assert plan.lanes_used == 1 and len(plan.busy_lanes()) == 1


@pytest.mark.parametrize("devices,lanes,policy", [
    (["cpu"], 1, "serial"), (["cpu"], 2, "heft"), (["cpu"], 3, "heft"), (["cpu"], 4, "auto"),
    (["cpu", "cpu"], 1, "heft"), (["cpu", "cpu"], 2, "auto"), (["cpu"] * 3, 1, "heft"),
])
def test_results_bitwise_equal_to_serial(lanes_config, devices, lanes, policy):
    xs, ms = branches(n=6, size=48, seed=3)
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=1, policy="serial")
    ref = branchy([x.to("mgpu") for x in xs]).cpu()
    torch_mgpu.configure(devices=devices, lanes_per_device=lanes, policy=policy)
    got = branchy(ms).cpu()
    assert torch.equal(got, ref)


def test_virtual_devices_transfer_values(lanes_config):
    torch_mgpu.configure(devices=["cpu", "cpu"], lanes_per_device=1, policy="heft")
    xs, ms = branches(n=4, size=96)
    before = torch_mgpu.stats()["bytes_transferred"]
    got = branchy(ms).cpu()
    torch.testing.assert_close(got, branchy(xs))
    plan = torch_mgpu.last_plan()
    lanes_seen = plan.busy_lanes()
    assert lanes_seen == {"cpu:0/lane0", "cpu:1/lane0"}
    assert plan.transfers > 0
    assert torch_mgpu.stats()["bytes_transferred"] > before


def test_plan_cache_hits_in_a_training_loop(lanes_config):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="auto")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to("mgpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8).to("mgpu")
    def step():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()
    for _ in range(4):  # a cached plan settles after its first four runs (see test_refine.py)
        step()
    s0 = torch_mgpu.stats()
    for _ in range(5):
        step()
    s1 = torch_mgpu.stats()
    assert s1["plan_cache_hits"] - s0["plan_cache_hits"] >= 5
    assert s1["plans_built"] == s0["plans_built"]


def test_a_training_loop_whose_python_scalars_change_keeps_its_plan(lanes_config):
    # Adam's bias corrections and a cosine schedule's learning rate are new
    # Python floats every step: the graph's hash sees through them (their
    # class, not their value), so after its warm-up the loop plans nothing.
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="auto")
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = copy.deepcopy(ref).to("mgpu")
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    xm, ym = x.to("mgpu"), y.to("mgpu")

    def trainer(m, inp, out):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)

        def step():
            opt.zero_grad()
            loss = (m(inp) - out).pow(2).mean()
            loss.backward()
            opt.step()
            sched.step()
            return loss.item()
        return step

    step_ref, step_mgpu = trainer(ref, x, y), trainer(model, xm, ym)
    for _ in range(6):  # warm-up: Adam's first steps, the cached plans' first runs
        assert step_mgpu() == pytest.approx(step_ref(), rel=1e-4, abs=1e-6)
    s0 = torch_mgpu.stats()
    for _ in range(6):
        assert step_mgpu() == pytest.approx(step_ref(), rel=1e-4, abs=1e-6)
    s1 = torch_mgpu.stats()
    assert s1["plans_built"] == s0["plans_built"]
    assert s1["plan_cache_hits"] - s0["plan_cache_hits"] >= 6
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=1e-5)


def fork_join(widths, size=64, seed=0):
    """Ragged fork-join: stages of parallel branches of uneven length, joined."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, size, generator=g).to("mgpu")
    for width in widths:
        outs = []
        for b in range(width):
            y = x
            for _ in range(1 + b % 3):
                y = torch.tanh(y @ x)
            outs.append(y)
        x = sum(outs) / width
    return x


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_simulator_above_lower_bound_and_not_worse_than_heft(devices):
    out = fork_join([devices * 2, devices * 3, devices * 2], size=256)
    auto = torch_mgpu.simulate(devices=devices, lanes_per_device=1, policy="auto")
    heft = torch_mgpu.simulate(devices=devices, lanes_per_device=1, policy="heft")
    assert torch_mgpu.pending_ops() > 0  # nothing ran
    # On a GPU's streams the bound is the devices' time, each kernel's by
    # the share of the device it fills, and the lanes' launches: at most
    # the host's bound. (A machine with a GPU starts on its streams.)
    gpu = torch_mgpu.simulate(devices=devices, lanes_per_device=2, policy="auto", device="h100")
    assert gpu.critical_path <= gpu.lower_bound <= max(gpu.critical_path, gpu.total_work / devices) * (1 + 1e-9)
    host_bound = max(auto.critical_path, auto.total_work / devices)
    if torch_mgpu.lanes()[0].startswith("cuda"):
        assert auto.critical_path <= auto.lower_bound <= host_bound * (1 + 1e-9)
    else:
        assert auto.lower_bound == pytest.approx(host_bound)
    assert auto.makespan >= auto.lower_bound * 0.999
    # auto keeps one lane unless a parallel plan beats it by 5% (its margin
    # for estimates): never worse than HEFT by more than that margin.
    assert auto.makespan <= heft.makespan / 0.95 * 1.0001
    if heft.makespan < 0.95 * auto.makespan:  # HEFT beats the margin: auto took a parallel plan
        assert auto.makespan <= heft.makespan * 1.0001
    # How close to the bound is a benchmark figure (benchmarks/), not a test.
    assert auto.plan is not None and len(auto.plan.lanes) == devices
    del out


def test_simulator_serial_equals_total_work_on_one_lane():
    x = torch.randn(32, 32, device="mgpu")
    y = torch.tanh(x @ x) + x
    s = torch_mgpu.simulate(devices=1, lanes_per_device=1, policy="serial")
    assert s.makespan >= s.total_work * 0.5
    assert s.critical_path <= s.total_work + 1e-12
    y.cpu()


def _chain(x, n=300):
    for k in range(n):
        x = x * 1.0001 + 0.5 if k % 2 else x - 0.25
    return x


@pytest.mark.parametrize("workload", ["branches", "chain"])
def test_simulate_predicts_the_plan_the_sync_runs(lanes_config, workload):
    # One planning for both: a simulation of the current lanes predicts what
    # the sync's plan predicts (fused chains included), first and later runs.
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="auto")
    xs, ms = branches(n=6, size=96, seed=3)
    with async_ops(0):
        for _ in range(6):
            out = branchy(ms) if workload == "branches" else _chain(ms[0])
            s = torch_mgpu.simulate(devices=1, lanes_per_device=2)
            other = torch_mgpu.simulate(devices=2, lanes_per_device=2)
            out.cpu()
            p = torch_mgpu.last_plan()
            assert s.makespan == pytest.approx(p.predicted_makespan, rel=1e-9, abs=1e-12)
            assert s.makespan >= s.lower_bound * 0.999 and other.makespan >= other.lower_bound * 0.999
            assert s.critical_path <= s.total_work + 1e-12
    if workload == "chain":
        assert p.fused_nodes > 0, "the chain ran fused"


def test_prediction_tracks_measurement_on_cpu_lanes(lanes_config):
    # The plan over two lanes is predicted as well as the same graph on one
    # lane, measured in turns with it: other work on the machine slows both
    # (a busy machine measured 0.25x its prediction for both), so their
    # ratios' quotient is the model's error in spreading the graph, not the
    # machine's load. Benchmarks report the figures themselves.
    xs, ms = branches(n=8, size=256)
    ratios = {2: [], 1: []}
    for _ in range(5):
        for lanes in (2, 1):
            torch_mgpu.configure(devices=["cpu"], lanes_per_device=lanes, policy="heft")
            branchy(ms).cpu()
            p = torch_mgpu.last_plan()
            ratios[lanes].append(p.predicted_makespan / p.measured_makespan)
    median = {k: sorted(v)[len(v) // 2] for k, v in ratios.items()}
    assert 0.25 < median[2] / median[1] < 4.0, ratios


def check_random_dag(rng, seed, lanes, n_ops):
    """A random lane configuration and program: mgpu equals eager."""
    devices = rng.choice([["cpu"], ["cpu", "cpu"]])
    torch_mgpu.configure(devices=devices, lanes_per_device=rng.choice(lanes),
                         policy=rng.choice(["serial", "heft", "auto"]))
    program = random_dag_program(rng, 3, rng.randrange(*n_ops))
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(16, 16, generator=g) for _ in range(3)]
    expected = program(inputs)
    got = program([t.to("mgpu") for t in inputs])
    for e, m in zip(expected, got):
        torch.testing.assert_close(m.cpu(), e)


@pytest.mark.parametrize("seed", range(12))
def test_random_dags_match_eager(lanes_config, seed):
    check_random_dag(random.Random(seed), seed, lanes=[1, 2, 3], n_ops=(5, 40))


def test_error_on_a_lane_surfaces_and_other_lanes_finish(lanes_config):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="heft")
    xs, ms = branches(n=6, size=64)
    good = [torch.tanh(m @ m) for m in ms]
    bad = ms[0].index_select(0, torch.tensor([0, 1000]).to("mgpu"))
    with pytest.raises((IndexError, RuntimeError)):
        torch_mgpu.synchronize()
    for m, x in zip(good, xs):
        torch.testing.assert_close(m.cpu(), torch.tanh(x @ x))
    with pytest.raises(RuntimeError):
        bad.cpu()
    # The same tensors keep working.
    torch.testing.assert_close((ms[1] + 1).cpu(), xs[1] + 1)


def test_profiler_records_nodes_on_lane_threads(lanes_config):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="heft")
    xs, ms = branches(n=4, size=96)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        branchy(ms).cpu()
    events = [e for e in prof.events() if e.name.startswith("mgpu::")]
    assert any(e.name == "mgpu::aten::mm" for e in events)
    assert len({e.thread for e in events}) >= 2


def test_small_products_on_one_lane_run_on_one_thread(lanes_config):
    # A one-lane plan has all the cores; products below the size that gains
    # from threads run on one (no intra-op team to wake), bitwise as eager.
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="serial")
    g = torch.Generator().manual_seed(4)
    small, big = torch.randn(48, 48, generator=g), torch.randn(400, 400, generator=g)
    s, b = small.to("mgpu"), big.to("mgpu")
    assert torch.equal((s @ s).cpu(), small @ small)
    assert torch.equal((b @ b).cpu(), big @ big)
    out_s, out_b = s @ s, b @ b
    torch_mgpu.synchronize()
    threads = {e["op"] + str(i): e["threads"] for i, e in enumerate(torch_mgpu.last_plan().timeline())}
    assert sorted(threads.values()) == sorted([1, torch.get_num_threads()])
    del out_s, out_b


def test_a_kept_plan_describes_its_own_graph(lanes_config):
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="heft")
    saved = torch_mgpu.async_ops()
    torch_mgpu.set_async_ops(0)
    try:
        xs, ms = branches(n=3, size=32)
        branchy(ms).cpu()
        first = torch_mgpu.last_plan()
        (ms[0] - 1).exp().cpu()  # a later sync, another graph
        second = torch_mgpu.last_plan()
    finally:
        torch_mgpu.set_async_ops(saved)
    ops = [e["op"] for e in first.timeline()]
    assert len(first) == len(ops) and ops.count("aten::mm") == 3 and "aten::exp" not in ops
    assert [e["op"] for e in second.timeline()] == ["aten::sub.Tensor", "aten::exp"]
    dot = first.to_dot()
    assert dot.startswith("digraph mgpu {") and dot.count("aten::mm") == 3 and "aten::exp" not in dot
    # Every edge of the graph is drawn: an mm feeds each tanh.
    assert dot.count("->") >= 3 * 3
    assert "aten::mm" in str(first) and "aten::exp" in str(second)
    assert first.graph_hash != second.graph_hash


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores: one thread against all of them")
def test_a_one_lane_plan_is_planned_with_the_syncing_threads_threads():
    # One lane runs on the thread that syncs, with its intra-op threads: the
    # plan predicts it so, and a background flight runs it so too. In a
    # process of its own: torch.set_num_threads changes MKL's threads for the
    # rest of a process (a forked child of this one would then start them).
    code = textwrap.dedent("""
        import torch, torch_mgpu
        torch_mgpu.configure(devices=["cpu"], lanes_per_device=1, policy="auto")
        g = torch.Generator().manual_seed(5)
        big = torch.randn(400, 400, generator=g)
        b = big.to("mgpu")
        predicted = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal((b @ b).cpu(), big @ big)
            (e,) = [e for e in torch_mgpu.last_plan().timeline() if e["op"] == "aten::mm"]
            assert e["threads"] == threads, e
            predicted[threads] = e["predicted_end"] - e["predicted_start"]
            # A flight (another thread) runs the same graph with them.
            flights = torch_mgpu.stats()["background_flushes"]
            torch_mgpu.set_async_ops(1)
            out = b @ b
            torch_mgpu.synchronize()
            torch_mgpu.set_async_ops(256)
            assert torch_mgpu.stats()["background_flushes"] == flights + 1
            (e,) = [e for e in torch_mgpu.last_plan().timeline() if e["op"] == "aten::mm"]
            assert e["threads"] == threads, e
            assert torch.equal(out.cpu(), big @ big)
        assert predicted[1] > 1.5 * predicted[2], predicted
        print("OK")
    """)
    # The model's own figures (not rates measured while other processes load
    # the machine): the prediction follows the threads alone.
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", TORCH_MGPU_NO_CALIBRATION="1"))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
