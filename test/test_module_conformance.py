"""Module behaviour that PyTorch's own module tests (test_modules.py and the
nn/ files, run for mgpu against CPU: docs/CONFORMANCE.md) found to differ
from eager CPU, each pinned here by a test of its own."""
import pytest
import torch

import torch_mgpu
from conftest import same_values


def _group_norm_grads(dev, module, x, grad_out, create_graph=False):
    m = torch.nn.GroupNorm(module.num_groups, module.num_channels, dtype=x.dtype)
    m.load_state_dict(module.state_dict())
    m = m.to(dev)
    xx = x.detach().to(dev).requires_grad_()
    out = m(xx)
    return (xx, m.weight), torch.autograd.grad(out, (xx, m.weight, m.bias), grad_out.to(dev), create_graph=create_graph)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grad_layout", ["contiguous", "channels_last"])
def test_group_norm_input_gradient_keeps_channels_last(dtype, grad_layout):
    # Autograd's formula makes the gradient and the input contiguous in the
    # input's memory format on the CPU only: mgpu follows the CPU's path.
    torch.manual_seed(0)
    module = torch.nn.GroupNorm(3, 6, dtype=dtype)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        module.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 6, 4, 4, dtype=dtype).to(memory_format=torch.channels_last)
    g = torch.randn(2, 6, 4, 4, dtype=dtype)
    if grad_layout == "channels_last":
        g = g.contiguous(memory_format=torch.channels_last)
    _, want = _group_norm_grads("cpu", module, x, g)
    _, got = _group_norm_grads("mgpu", module, x, g)
    assert want[0].stride() == (96, 1, 24, 6)
    for w, t in zip(want, got):
        assert t.stride() == w.stride()
        assert same_values(t.cpu(), w)


def test_group_norm_channels_last_double_backward_and_contiguous_input():
    torch.manual_seed(1)
    module = torch.nn.GroupNorm(2, 4, dtype=torch.float64)
    g = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    for layout in (torch.channels_last, torch.contiguous_format):
        x = torch.randn(2, 4, 3, 3, dtype=torch.float64).to(memory_format=layout)
        results = {}
        for dev in ("cpu", "mgpu"):
            leaves, grads = _group_norm_grads(dev, module, x, g, create_graph=True)
            # Second-order terms: the input gradient's own gradients.
            second = torch.autograd.grad(grads[0].square().sum(), leaves)
            results[dev] = [t.cpu() for t in grads + second], grads[0].stride()
        assert results["mgpu"][1] == results["cpu"][1]
        for w, t in zip(results["cpu"][0], results["mgpu"][0]):
            torch.testing.assert_close(t, w)
    torch_mgpu.synchronize()
