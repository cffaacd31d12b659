"""torch.accelerator, torch.Stream and torch.Event on mgpu: waiting for the
device runs what is pending and raises its errors, as
torch_mgpu.synchronize() does."""
import pytest
import torch

import torch_mgpu
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
    assert torch.equal(y.cpu(), x @ x)


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
        assert torch.equal(torch.tanh(x).cpu(), torch.tanh(x.cpu()))
    finally:
        _C._inject_fault("node", 0)
        torch_mgpu.set_async_ops(before)


def test_current_accelerator_and_bad_index():
    assert torch.accelerator.current_accelerator().type == "mgpu"
    assert torch.accelerator.device_count() == 1
    with pytest.raises(IndexError, match="out of range"):
        torch.accelerator.synchronize(3)
