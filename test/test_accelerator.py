"""torch.accelerator, torch.Stream and torch.Event on mgpu: waiting for the
device runs what is pending and raises its errors, as
torch_mgpu.synchronize() does."""
import os

import pytest
import torch

import torch_mgpu
from conftest import restore_lanes, same_values
from torch_mgpu import _C


def pending_product():
    torch.manual_seed(0)
    x = torch.randn(16, 16)
    y = x.to("mgpu") @ x.to("mgpu")
    assert torch_mgpu.pending_ops() > 0
    return x, y


@pytest.mark.parametrize("how", ["accelerator", "device_module", "stream", "event"])
def test_waiting_for_the_device_runs_what_is_pending(how):
    x, y = pending_product()
    syncs = torch_mgpu.stats()["syncs"]
    if how == "accelerator":
        torch.accelerator.synchronize()
    elif how == "device_module":
        torch.mgpu.synchronize()
    elif how == "stream":
        torch.Stream("mgpu").synchronize()
    else:
        e = torch.Event("mgpu")
        e.record()
        e.synchronize()
    assert torch_mgpu.pending_ops() == 0
    assert torch_mgpu.stats()["syncs"] > syncs
    assert same_values(y.cpu(), x @ x)


def test_accelerator_synchronize_raises_the_first_error():
    before = torch_mgpu.async_ops()
    torch_mgpu.set_async_ops(0)
    try:
        x = torch.randn(4, 4).to("mgpu")
        y = torch.tanh(x)
        _C._inject_fault("node", 1)
        with pytest.raises(RuntimeError, match="injected fault"):
            torch.accelerator.synchronize()
        with pytest.raises(RuntimeError, match="value was lost"):
            y.cpu()
        assert same_values(torch.tanh(x).cpu(), torch.tanh(x.cpu()))
    finally:
        _C._inject_fault("node", 0)
        torch_mgpu.set_async_ops(before)


def test_current_accelerator_and_device_index():
    assert torch.accelerator.current_accelerator().type == "mgpu"
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == 1 == torch.mgpu.device_count()
    torch.accelerator.set_device_index(0)
    assert torch.accelerator.current_device_index() == 0 == torch.mgpu.current_device()
    with torch.accelerator.device_index(0):
        assert torch.accelerator.current_device_index() == 0
    assert torch.mgpu.is_initialized()


@pytest.mark.parametrize("call", [
    lambda: torch.accelerator.synchronize(3),
    lambda: torch.accelerator.set_device_index(2),
    lambda: torch.mgpu.set_device(5),
    lambda: torch.mgpu.synchronize("mgpu:1"),
    lambda: torch.randn(2, device="mgpu:3"),
    lambda: torch.accelerator.memory_allocated(4),
])
def test_an_out_of_range_device_raises_what_cuda_raises(call):
    # CUDA: torch.AcceleratorError (a RuntimeError), "invalid device ordinal".
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
        call()


def test_device_name_and_properties():
    props = torch.mgpu.get_device_properties()
    assert props.multi_processor_count == len(torch_mgpu.lanes())
    assert props.devices == sorted({lane.split("/")[0] for lane in torch_mgpu.lanes()})
    assert props.total_memory == torch.mgpu.mem_get_info()[1] > 0
    assert torch.mgpu.get_device_name() == props.name == torch.mgpu.get_device_name("mgpu:0")
    assert f"{len(torch_mgpu.lanes())} lanes" in props.name
    with pytest.raises(AssertionError, match="Invalid device id"):  # as torch.cuda.get_device_properties
        torch.mgpu.get_device_properties(1)


def test_device_capability_is_the_lowest_of_the_lanes_gpus(monkeypatch):
    assert torch.mgpu.get_device_capability() == torch.mgpu.get_device_capability("mgpu:0")
    if not torch.cuda.is_available():
        assert torch.mgpu.get_device_capability() == (0, 0)  # CPU lanes: no GPU to describe
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.mgpu.get_device_capability(1)
    # Lanes on two GPUs of different generations: code for mgpu may assume
    # only what both have.
    from torch_mgpu import device as mgpu_device
    monkeypatch.setattr(mgpu_device._C, "lanes", lambda: ["cuda:0/stream0", "cuda:1/stream0"])
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda index=None: (1, 2))
    caps = {"cuda:0": (9, 0), "cuda:1": (8, 6)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: caps[d])
    assert torch.mgpu.get_device_capability() == (8, 6)


def test_device_description_follows_the_lanes():
    before, policy = torch_mgpu.lanes(), torch_mgpu.policy()
    try:
        torch_mgpu.configure(devices=["cpu", "cpu"], lanes_per_device=1)
        props = torch.mgpu.get_device_properties(0)
        assert props.devices == ["cpu:0", "cpu:1"]
        assert props.multi_processor_count == 2
    finally:
        restore_lanes(before, policy)


def _child_reports(after_fork):
    """Forks; the child runs `after_fork` and exits with its int result."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = int(after_fork())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_uses_mgpu_on_one_lane_and_torch_manual_seed_seeds_it():
    # CPU lanes, whose threads a fork leaves behind (a machine with a GPU
    # starts on its streams, and CUDA does not work in a forked child: see
    # the test below).
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2)
    try:
        _fork_on_cpu_lanes()
    finally:
        restore_lanes(*before)


def _fork_on_cpu_lanes():
    assert not torch.mgpu._is_in_bad_fork()
    x = torch.randn(64, 64)
    # Two independent products: a plan over both lanes starts their threads.
    a, b = x.to("mgpu") @ x.to("mgpu"), (x.to("mgpu") * 2) @ x.to("mgpu")
    torch_mgpu.synchronize()
    torch.manual_seed(1234)
    parent_draw = torch.randn(16, device="mgpu").cpu()
    torch.manual_seed(99)  # the child inherits this state

    def child():
        if not torch.mgpu._in_forked_child_with_lanes():
            return 1
        if torch.mgpu._is_in_bad_fork():  # mgpu works here: torch.manual_seed must seed it
            return 2
        # PyTorch's OpenMP pool does not survive a fork (eager ops hang on
        # it): a forked child works with one intra-op thread, as DataLoader
        # workers do. mgpu works there, on one lane.
        torch.set_num_threads(1)
        torch.manual_seed(1234)
        if not torch.equal(torch.randn(16, device="mgpu").cpu(), parent_draw):
            return 3
        y = (x.to("mgpu") @ x.to("mgpu")).tanh().cpu()
        return 0 if torch.allclose(y, (x @ x).tanh()) else 4

    assert _child_reports(child) == 0
    assert not torch.mgpu._in_forked_child_with_lanes()
    assert torch.allclose(a.cpu(), x @ x) and torch.allclose(b.cpu(), (x * 2) @ x)


def test_a_forked_child_on_gpu_lanes_is_in_a_bad_fork_as_cuda_is(monkeypatch):
    # On a GPU's streams mgpu is CUDA: a forked child of a process that used
    # CUDA cannot (torch.manual_seed then skips mgpu, as it skips CUDA). On
    # CPU lanes it works in the child (the test above).
    from torch_mgpu import device as mgpu_device
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    for lanes, bad in [(["cuda:0/stream0", "cuda:0/stream1"], True), (["cpu:0/lane0", "rank1:cuda:0/stream0"], False),
                       (["cpu:0/lane0", "cpu:0/lane1"], False)]:
        monkeypatch.setattr(mgpu_device._C, "lanes", lambda lanes=lanes: lanes)
        assert torch.mgpu._is_in_bad_fork() is bad, lanes
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    monkeypatch.setattr(mgpu_device._C, "lanes", lambda: ["cuda:0/stream0"])
    assert torch.mgpu._is_in_bad_fork() is False
