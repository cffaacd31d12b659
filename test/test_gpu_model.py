"""The GPU cost model (plan/topology.h): built-in device profiles, streams of
one device sharing it, links between devices; simulate(device=...) plans
for GPUs this machine does not have. Nothing here runs the planned work."""
import pytest
import torch

import torch_mgpu
from conftest import async_ops


@pytest.fixture(autouse=True)
def _no_flights():
    # Everything recorded stays pending (simulate plans what is pending) and
    # is dropped unrun.
    with async_ops(0):
        yield


def d2l_runs(n_runs, size=4000, products=50):
    """d2l's automatic-parallelism example: per run, 50 products of one
    4000x4000 matrix by itself."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(size, size, generator=g).to("mgpu") for _ in range(n_runs)]
    return [[x.mm(x) for _ in range(products)] for x in xs]


def test_profiles_are_published_figures():
    profiles = torch_mgpu.device_profiles()
    assert {"v100", "a100", "h100", "h200", "l4"} <= set(profiles)
    h100 = profiles["h100"]
    assert h100["sms"] == 132
    assert 40e12 < h100["fp32_flops_per_s"] < 67e12  # sustained, below the 67 TFLOP/s peak
    assert profiles["h200"]["memory_bytes_per_s"] > h100["memory_bytes_per_s"]
    assert profiles["l4"]["peer_bytes_per_s"] == 0  # PCIe only
    with pytest.raises(RuntimeError, match="unknown device profile 'b200'.*h100"):
        torch_mgpu.simulate(device="b200")


def test_d2l_two_runs_take_as_long_as_one_on_two_gpus():
    # d2l's figures (V100s): one run 0.50 s; both runs on two GPUs together
    # 0.50 s. On one GPU with two streams the products (each fills the
    # device) do not overlap: twice as long.
    runs = d2l_runs(1)
    one = torch_mgpu.simulate(devices=1, lanes_per_device=1, device="v100")
    assert 0.45 < one.makespan < 0.55, one
    del runs
    runs = d2l_runs(2)
    two_gpus = torch_mgpu.simulate(devices=2, lanes_per_device=1, device="v100", policy="heft")
    one_gpu_two_streams = torch_mgpu.simulate(devices=1, lanes_per_device=2, device="v100", policy="heft")
    assert 0.45 < two_gpus.makespan < 0.56, two_gpus
    assert 0.9 < one_gpu_two_streams.makespan < 1.1, one_gpu_two_streams
    # Both GPUs used, the bound respected.
    assert two_gpus.plan.lanes_used == 2
    assert two_gpus.lower_bound <= two_gpus.makespan * (1 + 1e-9)
    del runs


def test_small_kernels_overlap_on_streams_large_ones_do_not():
    g = torch.Generator().manual_seed(1)
    small = [torch.randn(128, 128, generator=g).to("mgpu") for _ in range(32)]
    ys = [torch.tanh(x @ x) for x in small]
    s1 = torch_mgpu.simulate(devices=1, lanes_per_device=1, device="h100")
    s4 = torch_mgpu.simulate(devices=1, lanes_per_device=4, device="h100", policy="heft")
    # A 128x128 product fills one SM of 132: four streams run four at once.
    assert s4.makespan < 0.6 * s1.makespan, (s1, s4)
    del ys, small
    large = [torch.randn(2048, 2048, generator=g).to("mgpu") for _ in range(8)]
    ys = [x @ x for x in large]
    l1 = torch_mgpu.simulate(devices=1, lanes_per_device=1, device="h100")
    l4 = torch_mgpu.simulate(devices=1, lanes_per_device=4, device="h100", policy="heft")
    assert l4.makespan > 0.9 * l1.makespan, (l1, l4)  # one device's worth of SMs, however many streams
    # The auto policy does not spread them over streams for nothing.
    auto = torch_mgpu.simulate(devices=1, lanes_per_device=4, device="h100")
    assert auto.makespan <= l4.makespan * (1 + 1e-9)
    del ys


def test_more_gpus_never_predict_slower_and_stay_above_the_bound():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(1024, 1024, generator=g).to("mgpu") for _ in range(16)]
    ys = [torch.relu(x @ x) @ x for x in xs]
    total = sum(y.sum() for y in ys)
    previous = float("inf")
    for k in (1, 2, 4, 8):
        s = torch_mgpu.simulate(devices=k, lanes_per_device=2, device="a100")
        assert s.lower_bound <= s.makespan * (1 + 1e-9), (k, s)
        assert s.makespan <= previous * 1.02, (k, s)
        previous = s.makespan
    one = torch_mgpu.simulate(devices=1, lanes_per_device=2, device="a100")
    eight = torch_mgpu.simulate(devices=8, lanes_per_device=2, device="a100")
    assert one.makespan / eight.makespan > 3  # 16 independent branches
    del ys, total


def test_transfers_between_gpus_use_the_peer_link():
    # One value made on one GPU and read on another: NVLink (h100) is far
    # faster than going through the host (l4, PCIe only).
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4096, 4096, generator=g).to("mgpu") for _ in range(2)]
    a = xs[0] @ xs[0]
    b = xs[1] @ xs[1]
    c = a + b  # needs both: one crosses devices
    def cross_cost(profile):
        two = torch_mgpu.simulate(devices=2, lanes_per_device=1, device=profile, policy="heft")
        one = torch_mgpu.simulate(devices=1, lanes_per_device=1, device=profile, policy="heft")
        assert two.plan.transfers >= 1
        return two, one
    h_two, h_one = cross_cost("h100")
    l_two, l_one = cross_cost("l4")
    # 64 MiB over NVLink is ~0.2 ms, over PCIe via the host ~3 ms.
    assert h_two.makespan < h_one.makespan
    assert l_two.makespan - 0.5 * l_one.makespan > h_two.makespan - 0.5 * h_one.makespan
    del c, a, b


def test_cpu_simulation_is_unchanged_by_the_gpu_model(cpu_lanes):
    # Without a profile, virtual devices are like the current (CPU) ones.
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(64, 64, generator=g).to("mgpu") for _ in range(8)]
    ys = [torch.tanh(x @ x) for x in xs]
    s = torch_mgpu.simulate(devices=2, lanes_per_device=2)
    assert s.plan.lanes and all(name.startswith("cpu") for name in s.plan.lanes), s.plan.lanes
    assert s.lower_bound <= s.makespan * (1 + 1e-9)
    gpu = torch_mgpu.simulate(devices=2, lanes_per_device=2, device="h100")
    assert all(name.startswith("cuda:") and "/stream" in name for name in gpu.plan.lanes), gpu.plan.lanes
    del ys
