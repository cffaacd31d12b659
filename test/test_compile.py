"""torch.compile(model, backend="mgpu"): inductor partitions run as engine nodes.

Every compiled result is checked against eager CPU on random inputs; the
partitioner's invariants are checked on random graphs without compiling."""
import copy
import random
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torch_mgpu
from torch_mgpu import _C, _partition
from torch_mgpu import compile as mgpu_compile
from torch_mgpu.compile import partition_info

TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def no_compile_in_the_background():
    """Tier 1's compiles of earlier tests' graphs are done first: FX keeps
    its tracing state per process (the patcher, the tracing flag), and a
    make_fx here beside the compile thread's trace ends with the other's
    state (the flag left set for good, every later torch.compile refused)."""
    assert torch_mgpu.wait_for_compiles(300)


@pytest.fixture
def choice(request, monkeypatch):
    """How split graphs run on host tensors (compile.CHOICE), for one test."""
    monkeypatch.setattr(mgpu_compile, "CHOICE", request.param)
    return request.param


def graphs_after(newest):
    """compile_choices() of the graphs compiled after the one with id `newest`."""
    return [g for g in torch_mgpu.compile_choices() if g["id"] > newest]


def newest_graph():
    return max((g["id"] for g in torch_mgpu.compile_choices()), default=-1)


def partitions_of(plan):
    return [e for e in plan.timeline() if e["op"].startswith("partition#")]


def branches(a, b):
    return sum(torch.tanh(a[i] @ b[i]).relu() for i in range(a.shape[0]))


# -- the partitioner, on ATen graphs (no compiling) --------------------------

def check_split(gm, groups):
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr")]
    flat = [n for g in groups for n in g]
    assert sorted(map(str, flat)) == sorted(map(str, compute)), "every op in exactly one partition"
    assert len(set(flat)) == len(flat)
    seen = set()
    for g in groups:  # each partition reads only earlier partitions and the inputs
        members = set(g)
        for n in g:
            for i in n.all_input_nodes:
                assert i.op == "placeholder" or i in seen or i in members, (n, i)
        seen |= members


def test_split_finds_the_branches_and_keeps_a_chain_whole():
    a, b = torch.randn(4, 256, 256), torch.randn(4, 256, 256)
    gm = make_fx(branches)(a, b)
    groups = _partition.split(gm, lanes=2)
    check_split(gm, groups)
    mm_groups = [g for g in groups if any(_partition.op_name(n) == "mm" for n in g)]
    assert len(mm_groups) >= 2, [[_partition.op_name(n) for n in g] for g in groups]
    assert len(_partition.split(gm, lanes=1)) == 1

    def chain(x):
        for _ in range(20):
            x = torch.tanh(x @ x) * 0.5
        return x
    gm = make_fx(chain)(torch.randn(64, 64))
    assert len(_partition.split(gm, lanes=2)) == 1


def random_program(rng, n_ops, size):
    def f(x, y):
        pool = [x, y]
        for _ in range(n_ops):
            kind = rng.choice(["mm", "add", "tanh", "mul", "sum"])
            a = rng.choice(pool)
            if kind == "mm":
                pool.append(a @ rng.choice(pool))
            elif kind == "add":
                pool.append(a + rng.choice(pool))
            elif kind == "tanh":
                pool.append(torch.tanh(a))
            elif kind == "mul":
                pool.append(a * 0.5)
            else:
                pool.append(a.sum(0, keepdim=True).expand(size, size))
        return tuple(pool[-3:])
    return f


@pytest.mark.parametrize("seed", range(12))
def test_split_invariants_on_random_graphs(seed):
    rng = random.Random(seed)
    size = rng.choice([8, 96, 200])
    f = random_program(rng, rng.randint(3, 40), size)
    gm = make_fx(f)(torch.randn(size, size), torch.randn(size, size))
    for lanes in (1, 2, 4):
        groups = _partition.split(gm, lanes)
        check_split(gm, groups)
        if lanes == 1:
            assert len(groups) == 1


def test_units_are_ordered_after_what_they_read_and_in_graph_order_where_free():
    # An effectful call joins the unit of the value it reads, which can come
    # before another value it reads: the split then orders units so each
    # comes after its inputs, keeping graph order among those that are free.
    class N:
        def __init__(self, *reads):
            self.all_input_nodes = list(reads)

    a, b = N(), N()
    c = N(a, b)
    d = N()
    e = N(d)
    in_order = [[a], [b, c], [d, e]]
    assert _partition._in_dependency_order(in_order, None) is in_order
    f, x = N(e), N()  # unit 0 reads unit 3's e, which reads unit 1's d
    units = [[a, f], [d], [b, c], [e], [x]]
    got = _partition._in_dependency_order(units, None)
    assert [u[0] for u in got] == [d, e, a, b, x]
    g, h = N(), N()
    g.all_input_nodes = [h]
    h.all_input_nodes = [g]
    with pytest.raises(AssertionError, match="cycle"):
        _partition._in_dependency_order([[g], [h]], None)


def test_the_split_prices_ops_with_the_engines_model():
    # One cost model: an op's work comes from the rules the planner prices
    # recorded ops by (sqrt is one vector instruction there, not a
    # transcendental; a view is free), its seconds from the calibrated rates.
    x = torch.randn(64, 32)
    gm = make_fx(lambda x: (torch.sqrt(x.abs()).t() @ x.tanh(), x[0]))(x)
    work = {_partition.op_name(n): _partition.node_work(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert work["sqrt"] == {"gemm_flops": 0.0, "elem": 2048.0, "transcendental": 0.0, "bytes": 2 * 2048 * 4.0}
    assert work["tanh"]["transcendental"] == 2048 and work["tanh"]["elem"] == 0
    assert work["mm"]["gemm_flops"] == 2 * 32 * 64 * 32
    assert work["t"] == work["select.int"] == {"gemm_flops": 0.0, "elem": 0.0, "transcendental": 0.0, "bytes": 0.0}
    cm = _C._cost_model()
    one = _partition.seconds(work["tanh"], 1)
    assert one == pytest.approx(cm["op_overhead_s"] + max(2048 / cm["transcendental_per_s"],
                                                         work["tanh"]["bytes"] / (cm["bytes_per_s"] * 2)), rel=0.3)
    assert not [k for k in vars(_partition) if k.endswith("_S") or k.endswith("_PER_S")], "rates live in C++"


def test_the_split_asks_the_engines_list_scheduler(monkeypatch):
    call = _C._cost_model()["partition_call_s"]
    # Two independent pieces on two lanes, or one after the other on one.
    assert _C._partition_makespan([1e-3, 1e-3], [[], []], 2) == pytest.approx(1e-3 + call)
    assert _C._partition_makespan([1e-3, 1e-3], [[], [0]], 2) == pytest.approx(2 * (1e-3 + call))
    assert _C._partition_makespan([1e-3, 1e-3], [[], []], 1) == pytest.approx(2 * (1e-3 + call))
    with pytest.raises(RuntimeError, match="must come after"):
        _C._partition_makespan([1e-3, 1e-3], [[1], []], 2)
    a, b = torch.randn(4, 256, 256), torch.randn(4, 256, 256)
    gm = make_fx(branches)(a, b)
    assert len(_partition.split(gm, lanes=2)) >= 2
    # The split is kept only if that schedule beats one piece: branches
    # that cost less than a partition's call stay one piece.
    gm = make_fx(branches)(torch.randn(4, 4, 4), torch.randn(4, 4, 4))
    assert len(_partition.split(gm, lanes=2)) == 1
    # The engine's split itself: independent work in two groups on two
    # lanes; the same behind a dependency, or on one lane, in one.
    assert _C._split_groups([1e-2, 1e-2], [[], []], 2) == [[0], [1]]
    assert _C._split_groups([1e-2, 1e-2], [[], [0]], 2) == [[0, 1]]
    assert _C._split_groups([1e-2, 1e-2], [[], []], 1) == [[0, 1]]
    assert _C._split_groups([1e-7, 1e-7], [[], []], 2) == [[0, 1]]


def test_many_small_branches_stay_with_their_join():
    # 64 branches, each too small for a partition's call, joined at the end:
    # each moves into the join, one partition (tier 1 of the lazy path,
    # which compiles in the background, bundles them instead: test_plan's
    # Groups tests, test_tiers).
    call = _C._cost_model()["partition_call_s"]
    n = 64
    cost = [call] * n + [call]
    preds = [[] for _ in range(n)] + [list(range(n))]
    assert _C._split_groups(cost, preds, 2) == [list(range(n + 1))]


# -- the partition op --------------------------------------------------------

def make_partition(fn, inputs, outputs):
    meta = [torch.empty_like(t, device="meta") for t in inputs]
    return _C._make_partition(fn, ["test"], 1, meta, [torch.empty_like(t, device="meta") for t in outputs],
                              {"elem": float(sum(t.numel() for t in outputs))})


def test_partition_op_checks_its_inputs_and_reports_errors_of_its_code():
    a = torch.randn(3, 4)
    p = make_partition(lambda xs: [xs[0] * 2], [a], [a])
    torch.testing.assert_close(_C._call_partition(p, [a])[0], a * 2)
    with pytest.raises(RuntimeError, match=r"partition#\d+\[test; 1 kernel\] takes 1 tensors, got 2"):
        _C._call_partition(p, [a, a])
    with pytest.raises(RuntimeError, match="input 0 must be Float of shape \\[3, 4\\]"):
        _C._call_partition(p, [torch.randn(4, 3)])

    def boom(xs):
        raise ValueError("compiled code failed")
    bad = make_partition(boom, [a], [a])
    x = a.to("mgpu")
    good = x + 1
    failed = _C._call_partition(bad, [x])[0]
    with pytest.raises(ValueError, match="compiled code failed"):  # its class kept
        torch_mgpu.synchronize()
    # The failure left every other tensor usable.
    torch.testing.assert_close(good.cpu(), a + 1)
    torch.testing.assert_close(x.cpu(), a)
    with pytest.raises(RuntimeError, match="value was lost when an op failed: compiled code failed"):
        failed.cpu()


# -- compiled models against eager -------------------------------------------

@pytest.mark.parametrize("choice", ["partitions"], indirect=True)
def test_branches_with_cpu_inputs_run_as_partitions_on_the_lanes(choice):
    torch.manual_seed(0)
    a, b = torch.randn(4, 256, 256), torch.randn(4, 256, 256)
    f = torch.compile(branches, backend="mgpu")
    out = f(a, b)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, branches(a, b), **TOL)
    parts = partitions_of(torch_mgpu.last_plan())
    assert len(parts) >= 2, torch_mgpu.last_plan()
    # The engine plans the partitions with its cost model: side by side where
    # that pays, else in a row (on two cores a GEMM partition above the
    # model's parallel threshold uses both cores: that depends on the rates
    # this machine calibrated). Either way no worse than one after another.
    plan = torch_mgpu.last_plan()
    serial = sum(p["predicted_end"] - p["predicted_start"] for p in parts)
    span = max(p["predicted_end"] for p in parts) - min(p["predicted_start"] for p in parts)
    assert span <= serial * 1.0001 + 1e-6, plan
    if len({p["lane"] for p in parts}) > 1:
        assert any(p["predicted_start"] < q["predicted_end"] and q["predicted_start"] < p["predicted_end"]
                   and p["lane"] != q["lane"] for p in parts for q in parts), plan
    out = f(a, b)  # a second call: the cached plan
    torch.testing.assert_close(out, branches(a, b), **TOL)
    info = partition_info(parts[0]["op"])
    assert "mm" in info.ops and info.kernels >= 1 and info.work["gemm_flops"] > 0
    listed = torch_mgpu.last_plan().partitions()
    assert [p["name"] for p in listed] == [e["op"] for e in parts]
    assert all(p["measured"] > 0 and p["predicted"] > 0 and p["kernels"] >= 1 for p in listed)
    assert torch_mgpu.pending_ops() == 0  # CPU in, CPU out: nothing left pending


def test_branches_with_mgpu_inputs_join_the_pending_graph():
    torch.manual_seed(1)
    a, b = torch.randn(4, 256, 256), torch.randn(4, 256, 256)
    f = torch.compile(branches, backend="mgpu")
    am, bm = a.to("mgpu"), b.to("mgpu")
    before = torch.sin(am)          # eager mgpu code ...
    out = f(am, bm) + before.sum()  # ... compiled code, and eager again
    assert out.device.type == "mgpu" and torch_mgpu.pending_ops() > 0
    torch.testing.assert_close(out.cpu(), branches(a, b) + torch.sin(a).sum(), **TOL)
    plan = torch_mgpu.last_plan()
    ops = [e["op"] for e in plan.timeline()]
    assert any(o.startswith("partition#") for o in ops) and "aten::sin" in ops


def test_mlp_training_matches_eager_and_stays_one_inductor_call():
    torch.manual_seed(2)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = copy.deepcopy(ref)
    fast = torch.compile(model, backend="mgpu")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(8, 16)
        captured = torch_mgpu.stats()["ops_captured"]
        loss = fast(x).square().mean()
        loss.backward()
        # No branches: the graph is one inductor call, the engine untouched.
        assert torch_mgpu.stats()["ops_captured"] == captured
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL)
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def test_an_optimizer_step_writes_its_state_in_place_as_inductor_does():
    """A compiled graph that writes its inputs (foreach Adam's parameters,
    moments and step counts) runs whole on host tensors with the writes in
    inductor's code: no copy into each written tensor after the call."""
    def train(backend, steps):
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        step = torch.compile(opt.step, backend=backend) if backend else opt.step
        for _ in range(steps):
            step()
        with torch.profiler.profile() as prof:
            step()
        copies = sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")
        return [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"], copies

    torch._dynamo.reset()
    ref, ref_state, _ = train(None, 3)
    params, state, copies = train("mgpu", 3)
    _, _, inductor_copies = train("inductor", 3)
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q, **TOL)
    for k in ref_state:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(state[k][name], ref_state[k][name], **TOL)
    assert copies == inductor_copies, (copies, inductor_copies)


class Tower(torch.nn.Module):
    def __init__(self, c, k):
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, k, padding=k // 2)
        self.bn = torch.nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class FourTowers(torch.nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.towers = torch.nn.ModuleList([Tower(c, k) for k in (1, 3, 5, 3)])

    def forward(self, x):
        return torch.cat([t(x) for t in self.towers], 1)


@pytest.mark.parametrize("device,choice", [("cpu", "partitions"), ("cpu", "whole"), ("mgpu", "measure")],
                         indirect=["choice"])
def test_four_tower_conv_block_training_and_batchnorm_buffers(device, choice):
    torch.manual_seed(3)
    ref = FourTowers()
    model = copy.deepcopy(ref).to(device)
    fast = torch.compile(model, backend="mgpu")
    x = torch.randn(4, 8, 16, 16)
    out = fast(x.to(device))
    assert out.device.type == device
    out.square().mean().backward()
    ref_out = ref(x)
    ref_out.square().mean().backward()
    torch.testing.assert_close(out.cpu(), ref_out, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, **TOL)
    # No grad, training mode: an inference graph that writes the running
    # statistics; then eval mode.
    with torch.no_grad():
        torch.testing.assert_close(fast(x.to(device)).cpu(), ref(x), **TOL)
        for b, rb in zip(model.buffers(), ref.buffers()):
            torch.testing.assert_close(b.cpu(), rb, **TOL)
        model.eval(), ref.eval()
        torch.testing.assert_close(fast(x.to(device)).cpu(), ref(x), **TOL)


def one_conv():
    return torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU())


@pytest.mark.parametrize("choice", ["whole"], indirect=True)
@pytest.mark.parametrize("make", [FourTowers, one_conv])
def test_a_conv_block_saves_its_activations_in_inductors_layouts(choice, make):
    """The whole graph's code (of a split graph, or of one not split) lays
    out what the forward saves for the backward as inductor alone does
    (channels-last around convolutions on the CPU), and the backward is
    compiled for those layouts."""
    def saved_strides(backend):
        torch.manual_seed(6)
        torch._dynamo.reset()
        model = make()
        fast = torch.compile(model, backend=backend)
        x = torch.randn(4, 8, 16, 16)
        strides = []

        def pack(t):
            # (a dim of one element has any stride)
            strides.append((tuple(t.shape), tuple(s if n > 1 else 0 for n, s in zip(t.shape, t.stride()))))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fast(x)
        out.square().mean().backward()
        return strides, out, [p.grad for p in model.parameters()]

    ref, ref_out, ref_grads = saved_strides("inductor")
    got, out, grads = saved_strides("mgpu")
    contiguous = [(shape, tuple(s if n > 1 else 0 for n, s in zip(shape, torch.empty(shape).stride()))) for shape, _ in ref]
    assert sorted(ref) != sorted(contiguous), ref  # channels-last somewhere
    assert sorted(got) == sorted(ref)
    torch.testing.assert_close(out, ref_out, **TOL)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **TOL)


def test_partitions_and_the_whole_graph_take_turns_in_training_with_inductors_layouts():
    """A split conv block's forward and backward measure their two ways
    apart (a forward may run with no backward): the forward's partitions
    hand the backward what the whole graph's code would, in its layouts (an
    input saved converted to channels-last included)."""
    torch.manual_seed(7)
    torch._dynamo.reset()
    ref = FourTowers()
    model = copy.deepcopy(ref)
    fast = torch.compile(model, backend="mgpu")
    x = torch.randn(4, 8, 16, 16)
    torch.testing.assert_close(fast(x), ref(x), **TOL)  # no backward: the ways go out of step
    for _ in range(2 * (mgpu_compile.TRIALS + 1) + 1):
        out, ref_out = fast(x), ref(x)
        out.square().mean().backward()
        ref_out.square().mean().backward()
        torch.testing.assert_close(out, ref_out, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_a_conv_block_with_batchnorm_and_dynamic_sizes_trains():
    torch.manual_seed(8)
    torch._dynamo.reset()
    ref = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    model = copy.deepcopy(ref)
    fast = torch.compile(model, backend="mgpu", dynamic=True)
    for size in (12, 10):
        x = torch.randn(4, 8, size, size)
        out, ref_out = fast(x), ref(x)
        out.sum().backward()
        ref_out.sum().backward()
        torch.testing.assert_close(out, ref_out, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    for b, rb in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb, **TOL)


def test_transformer_encoder_layer_on_mgpu_parameters():
    torch.manual_seed(4)
    ref = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = copy.deepcopy(ref).to("mgpu")
    fast = torch.compile(model, backend="mgpu")
    x = torch.randn(2, 10, 32)
    out = fast(x.to("mgpu"))
    out.sum().backward()
    ref_out = ref(x)
    ref_out.sum().backward()
    torch.testing.assert_close(out.cpu(), ref_out, **TOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-3, rtol=1e-3, msg=name)


def test_lstm_cell_loop_training():
    torch.manual_seed(5)
    ref = torch.nn.LSTMCell(8, 16)
    model = copy.deepcopy(ref)

    def unroll(cell, xs):
        h = c = torch.zeros(xs.shape[1], 16)
        for x in xs:
            h, c = cell(x, (h, c))
        return h

    fast = torch.compile(lambda xs: unroll(model, xs), backend="mgpu")
    xs = torch.randn(6, 3, 8)
    out = fast(xs)
    out.sum().backward()
    ref_out = unroll(ref, xs)
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out, **TOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def kernel_methods(x, y, queries, means):
    d2 = (x * x).sum(1, keepdim=True) - 2 * x @ x.t() + (x * x).sum(1)
    gp = []
    for s in (0.5, 1.0, 2.0):  # GP posterior means, one per length-scale
        k = torch.exp(-d2 / (2 * s * s)) + 0.1 * torch.eye(x.shape[0])
        gp.append(k @ torch.cholesky_solve(y, torch.linalg.cholesky(k)))
    knn = [torch.cdist(q, x).topk(4, largest=False).values for q in queries]
    logp = torch.stack([-0.5 * ((x - m) ** 2).sum(1) for m in means], 1)  # a GMM E step, then M step
    resp = torch.softmax(logp, 1)
    new_means = (resp.t() @ x) / (resp.sum(0)[:, None] + 1e-6)
    return gp, knn, new_means


def test_kernel_methods_gp_knn_gmm():
    torch.manual_seed(6)
    x, y = torch.randn(96, 8), torch.randn(96, 2)
    queries = [torch.randn(32, 8) for _ in range(3)]
    means = torch.randn(4, 8)
    fast = torch.compile(kernel_methods, backend="mgpu")
    got = fast(x, y, queries, means)
    want = kernel_methods(x, y, queries, means)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def cholesky_heads(x, y, scales, jitter):
    # One GP posterior mean per length-scale, through a Cholesky each: the
    # graph's effectful checks (`_linalg_check_errors`) thread a token
    # through the heads.
    outs = []
    for i in range(scales.shape[0]):
        d2 = (x * x).sum(1, keepdim=True) - 2 * x @ x.t() + (x * x).sum(1)
        k = torch.exp(-d2 / (2 * scales[i] ** 2)) + jitter * torch.eye(x.shape[0])
        outs.append(k @ torch.cholesky_solve(y, torch.linalg.cholesky(k)))
    return outs


@pytest.mark.parametrize("choice", ["partitions"], indirect=True)
def test_heads_with_a_cholesky_each_split_with_their_checks_in_one_partition(choice):
    # The effect token of the Cholesky checks crossed partitions, and
    # inductor failed on the partition that returned it ("'NoneType' object
    # has no attribute 'get_size'"): the GP benchmark did not compile.
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g)
    scales, jitter = torch.tensor([0.5, 1.0, 2.0, 4.0]), torch.tensor(1e-2)
    newest = newest_graph()
    fast = torch.compile(cholesky_heads, backend="mgpu")
    torch.testing.assert_close(fast(x, y, scales, jitter), cholesky_heads(x, y, scales, jitter), atol=1e-3, rtol=1e-3)
    assert max(g["partitions"] for g in graphs_after(newest)) > 1  # the heads were split
    # The checks still run: a matrix that is not positive-definite raises
    # as eager's Cholesky does.
    with pytest.raises(torch.linalg.LinAlgError, match="not positive-definite"):
        cholesky_heads(x, y, scales, torch.tensor(-2.0))
    with pytest.raises(torch.linalg.LinAlgError, match="not positive-definite"):
        fast(x, y, scales, torch.tensor(-2.0))


def test_graph_break_and_dynamic_shapes():
    torch.manual_seed(7)

    def f(a, b):
        left = torch.tanh(a @ b)
        torch._dynamo.graph_break()
        return left + torch.sigmoid(b @ a)

    fast = torch.compile(f, backend="mgpu")
    a, b = torch.randn(24, 24), torch.randn(24, 24)
    torch.testing.assert_close(fast(a, b), f(a, b), **TOL)

    g = torch.compile(lambda a, b: torch.relu(a @ b) + a.sum(), backend="mgpu", dynamic=True)
    for n in (5, 9, 13):
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.testing.assert_close(g(a, b), torch.relu(a @ b) + a.sum(), **TOL)


@pytest.mark.parametrize("choice", ["partitions"], indirect=True)
def test_a_partition_that_reads_no_tensor(choice):
    torch.manual_seed(8)

    def f(a):
        return torch.tanh(a @ a), torch.exp(torch.eye(1000)) * 2

    a = torch.randn(300, 300)
    fast = torch.compile(f, backend="mgpu")
    for x in (a, a.to("mgpu")):
        got = fast(x)
        torch.testing.assert_close([g.cpu() for g in got], list(f(a)), **TOL)
    # torch.eye (decomposed: iota, eq) is a partition of its own, with no input.
    parts = partitions_of(torch_mgpu.last_plan())
    assert len(parts) == 2 and any("iota" in partition_info(p["op"]).ops for p in parts), parts


# -- the measured choice: partitions on the lanes, or the whole graph --------

def _slowed(monkeypatch, name, seconds):
    """CompiledGraph.<name> made slower by `seconds`, its calls counted."""
    calls = []
    original = getattr(mgpu_compile.CompiledGraph, name)

    def slow(self, *args):
        calls.append(name)
        out = original(self, *args)
        time.sleep(seconds)
        return out
    monkeypatch.setattr(mgpu_compile.CompiledGraph, name, slow)
    return calls


@pytest.mark.parametrize("slow,kept", [("_run_engine", "whole"), ("_run_whole", "partitions")])
def test_a_split_graph_keeps_the_way_its_first_calls_measured_faster(monkeypatch, slow, kept):
    torch.manual_seed(9)
    torch._dynamo.reset()  # `branches` compiled afresh, under this test's choice
    a, b = torch.randn(4, 256, 256), torch.randn(4, 256, 256)
    f = torch.compile(branches, backend="mgpu")
    before = newest_graph()
    calls = _slowed(monkeypatch, slow, 0.05)
    first = 2 * (mgpu_compile.TRIALS + 1)  # both ways: one cold call, then the timed ones
    for k in range(first + 4):
        torch.testing.assert_close(f(a, b), branches(a, b), **TOL)
        if k == first - 1:
            assert len(calls) == first // 2, calls  # the ways took turns
    assert len(calls) == first // 2, calls  # decided: the slowed way was not taken again
    (graph,) = graphs_after(before)
    assert graph["partitions"] >= 2 and graph["choice"] == kept, graph
    slow_s, fast_s = ((graph["partitions_s"], graph["whole_s"]) if kept == "whole"
                      else (graph["whole_s"], graph["partitions_s"]))
    assert slow_s > fast_s + 0.04, graph


def test_a_graph_measuring_its_choice_reports_none_and_one_partition_is_whole():
    torch.manual_seed(10)
    torch._dynamo.reset()
    a, b = torch.randn(4, 256, 256), torch.randn(4, 256, 256)
    f = torch.compile(branches, backend="mgpu")
    before = newest_graph()
    f(a, b)
    (graph,) = graphs_after(before)
    assert graph["choice"] is None and graph["partitions"] >= 2  # one cold call: nothing timed yet
    assert graph["partitions_s"] is None and graph["whole_s"] is None
    g = torch.compile(lambda x: torch.tanh(x @ x).sum(), backend="mgpu")
    x = torch.randn(64, 64)
    torch.testing.assert_close(g(x), torch.tanh(x @ x).sum(), **TOL)
    (last,) = graphs_after(graph["id"])
    assert last == {"id": last["id"], "partitions": 1, "choice": "whole", "partitions_s": None, "whole_s": None}


def test_an_unknown_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(mgpu_compile, "CHOICE", "fastest")
    f = torch.compile(lambda x: x.sin() + 1, backend="mgpu")
    with pytest.raises(Exception, match="TORCH_MGPU_COMPILE_CHOICE must be one of measure, partitions, whole"):
        f(torch.randn(8))
