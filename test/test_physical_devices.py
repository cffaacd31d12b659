"""The lanes' physical devices: each test runs on CPU lanes (always) and on
CUDA stream lanes where a GPU is present (`bash scripts/dev.sh gpu` runs this
file on a GPU machine). The same code proves the test logic here and the
stream path there: lanes on every device, virtual devices sharing one
device, values crossing devices, errors on a lane, random graphs, autograd
and the seeds' workloads, each against eager PyTorch on CPU."""
import random

import pytest
import torch

import torch_mgpu
from conftest import async_ops, random_dag_program, restore_lanes
from torch_mgpu import _C

KINDS = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def devices_of(kind, virtual=False):
    """Every device of that kind, or two virtual devices over the first."""
    if kind == "cpu":
        return ["cpu", "cpu"] if virtual else ["cpu"]
    if virtual:
        return ["cuda:0", "cuda:0"]
    return [f"cuda:{k}" for k in range(torch.cuda.device_count())]


def close(kind, got, want):
    # CPU lanes run CPU kernels (bitwise eager); GPU kernels sum in another order.
    if kind == "cpu":
        torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.fixture(params=KINDS)
def kind(request):
    before, policy = torch_mgpu.lanes(), torch_mgpu.policy()
    yield request.param
    restore_lanes(before, policy)


def branch_sum(xs):
    return sum(torch.tanh(x @ x).mul(0.5).add(1.0) for x in xs)


def test_lanes_on_every_device_run_independent_branches(kind):
    torch_mgpu.configure(devices=devices_of(kind), lanes_per_device=2, policy="heft")
    lanes = torch_mgpu.lanes()
    assert all(l.startswith(kind) for l in lanes)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(96, 96, generator=g) for _ in range(8)]
    close(kind, branch_sum([x.to("mgpu") for x in xs]).cpu(), branch_sum(xs))
    assert torch_mgpu.last_plan().lanes_used >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/dev.sh gpu runs it)")
def test_a_cuda_tensor_copies_to_mgpu_and_back(kind):
    # A CUDA tensor's value comes to mgpu (a new tensor, and copy_ into one
    # of another dtype), whatever the lanes; results go back to CUDA.
    torch_mgpu.configure(devices=devices_of(kind), lanes_per_device=1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 17, generator=g)
    c = x.to("cuda")
    m = c.to("mgpu")
    d = torch.zeros(33, 17, dtype=torch.float64, device="mgpu")
    d.copy_(c.t().contiguous().t())  # strided source, another dtype
    e = torch.zeros(33, 17, device="mgpu")
    e[::2].copy_(c[::2])  # a strided source into a view
    e[1::2].copy_(c[0])  # broadcast
    c.add_(1)  # a snapshot: later writes to the CUDA tensor do not reach it
    assert torch.equal(m.cpu(), x)
    assert torch.equal(d.cpu(), x.double())
    want = torch.zeros(33, 17)
    want[::2] = x[::2]
    want[1::2] = x[0]
    assert torch.equal(e.cpu(), want)
    back = (m * 2).to("cuda")
    assert back.is_cuda and torch.equal(back.cpu(), x * 2)


def test_virtual_devices_over_one_device_copy_values_between_them(kind):
    torch_mgpu.configure(devices=devices_of(kind, virtual=True), lanes_per_device=1, policy="heft")
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(64, 64, generator=g) for _ in range(4)]
    ms = [x.to("mgpu") for x in xs]
    # Two branches, one per device, joined: the join reads across devices.
    left, right = torch.tanh(ms[0] @ ms[1]), torch.tanh(ms[2] @ ms[3])
    out = left @ right
    close(kind, out.cpu(), torch.tanh(xs[0] @ xs[1]) @ torch.tanh(xs[2] @ xs[3]))
    plan = torch_mgpu.last_plan()
    assert plan.lanes_used == 2 and plan.transfers >= 1


def test_an_error_on_a_lane_leaves_every_tensor_usable(kind):
    torch_mgpu.configure(devices=devices_of(kind), lanes_per_device=2, policy="heft")
    with async_ops(0):
        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(32, 32, generator=g) for _ in range(4)]
        ms = [x.to("mgpu") for x in xs]
        outs = [torch.tanh(m @ m) for m in ms]
        _C._inject_fault("node", 3)  # the third node to run fails
        try:
            with pytest.raises(RuntimeError, match="injected fault"):
                torch_mgpu.synchronize()
        finally:
            _C._inject_fault("node", 0)
        lost = 0
        for out, x in zip(outs, xs):
            try:
                close(kind, out.cpu(), torch.tanh(x @ x))
            except RuntimeError as e:
                assert "value was lost" in str(e)
                lost += 1
        assert lost >= 1
        for m, x in zip(ms, xs):  # the inputs are intact and usable
            close(kind, (m * 2).cpu(), x * 2)


@pytest.mark.parametrize("seed", range(4))
def test_random_graphs_equal_eager(kind, seed):
    rng = random.Random(seed)
    torch_mgpu.configure(devices=devices_of(kind, virtual=rng.random() < 0.5), lanes_per_device=rng.choice([1, 2, 4]),
                         policy=rng.choice(["heft", "auto"]))
    program = random_dag_program(rng, 3, rng.randrange(10, 40))
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(24, 24, generator=g) for _ in range(3)]
    for got, want in zip(program([t.to("mgpu") for t in inputs]), program(inputs)):
        close(kind, got.cpu(), want)


def test_training_equals_eager(kind):
    torch_mgpu.configure(devices=devices_of(kind), lanes_per_device=2)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model.load_state_dict(ref.state_dict())
    model.to("mgpu")
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    for m, inp, tgt in [(ref, x, y), (model, x.to("mgpu"), y.to("mgpu"))]:
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(inp), tgt).backward()
            opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        close(kind, a.detach().cpu(), b.detach())


def test_kernel_method_heads_equal_eager(kind):
    # The seeds' kernel-method workload: one RBF Gram matrix per length scale.
    torch_mgpu.configure(devices=devices_of(kind), lanes_per_device=2)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(128, 8, generator=g), torch.randn(128, 1, generator=g)

    def heads(x, y):
        outs = []
        for ell in (0.5, 1.0, 2.0, 4.0):
            k = torch.exp(-torch.cdist(x, x).pow(2) / (2 * ell ** 2)) + 0.1 * torch.eye(x.shape[0], device=x.device)
            outs.append(torch.linalg.solve(k, y))
        return outs

    for got, want in zip(heads(x.to("mgpu"), y.to("mgpu")), heads(x, y)):
        close(kind, got.cpu(), want)


def test_memory_statistics_count_copies_on_other_devices(kind):
    # A host value read on a GPU is copied there once and the copy kept: it
    # is memory mgpu holds (device bytes). Intermediates are freed.
    import gc

    torch_mgpu.configure(devices=devices_of(kind, virtual=True), lanes_per_device=1, policy="heft")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 256, generator=g)
    xm = x.to("mgpu")
    gc.collect()
    torch_mgpu.synchronize()
    before = torch.accelerator.memory_allocated()
    # Four independent products of x: both devices read it.
    outs = [torch.tanh(xm * float(k)) @ xm for k in range(1, 5)]
    torch_mgpu.synchronize()
    assert torch_mgpu.last_plan().lanes_used == 2
    results = 4 * 256 * 256 * 4
    # Virtual devices over the host share its memory (no copy); on a GPU x
    # is copied to it once (both virtual devices are cuda:0) and kept.
    copy = 0 if kind == "cpu" else x.numel() * 4
    assert torch.accelerator.memory_allocated() - before == results + copy
    for k, out in enumerate(outs, start=1):
        close(kind, out.cpu(), torch.tanh(x * float(k)) @ x)


def test_attention_with_and_without_gradients(kind):
    # For mgpu tensors SDPA picks the CPU's fused kernel (and its backward),
    # which CUDA lacks: on CUDA lanes those nodes run on the host, counted.
    torch_mgpu.configure(devices=devices_of(kind), lanes_per_device=2)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(3))
    qm, km, vm = (t.to("mgpu").requires_grad_() for t in (q, k, v))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    host_before = torch_mgpu.stats()["host_nodes"]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out_m = torch.nn.functional.scaled_dot_product_attention(qm, km, vm, is_causal=True)
    out.square().sum().backward()
    out_m.square().sum().backward()
    close(kind, out_m.detach().cpu(), out.detach())
    for a, b in ((qm, q), (km, k), (vm, v)):
        close(kind, a.grad.cpu(), b.grad)
    host = torch_mgpu.stats()["host_nodes"] - host_before
    assert host == 0 if kind == "cpu" else host >= 2, host
