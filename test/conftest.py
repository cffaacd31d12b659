import pytest
import torch

import torch_mgpu  # noqa: F401  (registers the mgpu device)


@pytest.fixture(autouse=True)
def _clean_state():
    torch_mgpu.synchronize()
    yield
    # Work a test left pending (in the background too) runs here; an error
    # it raises fails the test that recorded it.
    torch_mgpu.synchronize()


def restore_lanes(lanes, policy):
    """Configures the lanes named by an earlier torch_mgpu.lanes() again
    (CPU devices, virtual or not, or CUDA devices), with `policy`."""
    devices = []
    for name in lanes:
        dev = name.split("/")[0]
        if dev not in devices:
            devices.append(dev)
    spec = ["cpu" if d.startswith("cpu") else d for d in devices]
    torch_mgpu.configure(devices=spec, lanes_per_device=len(lanes) // len(devices), policy=policy)


def assert_same(mgpu_tensor, cpu_tensor, exact=True):
    """The mgpu tensor, brought to the host, equals the eager CPU result."""
    assert mgpu_tensor.device.type == "mgpu", mgpu_tensor.device
    got = mgpu_tensor.cpu()
    assert got.shape == cpu_tensor.shape and got.dtype == cpu_tensor.dtype
    if exact:
        assert torch.equal(got, cpu_tensor), (got, cpu_tensor)
    else:
        torch.testing.assert_close(got, cpu_tensor)
