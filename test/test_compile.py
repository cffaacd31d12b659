"""torch.compile(model, backend="mgpu"): the compiled graph records lazily."""
import copy

import torch

import torch_mgpu


def test_compiled_module_forward_backward_match_cpu():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mg = copy.deepcopy(ref).to("mgpu")
    compiled = torch.compile(mg, backend="mgpu")
    x = torch.randn(5, 8)
    out = compiled(x.to("mgpu"))
    assert out.device.type == "mgpu"
    assert torch_mgpu.pending_ops() > 0  # recorded, not run
    torch.testing.assert_close(out.cpu(), ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    for p_ref, p_mg in zip(ref.parameters(), mg.parameters()):
        torch.testing.assert_close(p_mg.grad.cpu(), p_ref.grad)


def test_compiled_function_with_branches():
    def f(a, b):
        return sum(torch.tanh(a[i] @ b[i]) for i in range(4))
    compiled = torch.compile(f, backend="mgpu")
    a, b = torch.randn(4, 32, 32), torch.randn(4, 32, 32)
    torch.testing.assert_close(compiled(a.to("mgpu"), b.to("mgpu")).cpu(), f(a, b))
