"""Device registration: the mgpu device, its module, tensor methods, bad input."""
import copy

import pytest
import torch

import torch_mgpu


def test_device_and_module():
    assert torch.device("mgpu").type == "mgpu"
    assert torch.mgpu.is_available()
    assert torch.mgpu.device_count() == 1
    torch.mgpu.synchronize()
    x = torch.randn(3, device="mgpu")
    assert x.is_mgpu and x.device == torch.device("mgpu:0")
    y = torch.randn(3).mgpu()
    assert y.is_mgpu
    assert not torch.randn(2).is_mgpu


def test_factories_and_metadata_without_running():
    x = torch.ones(2, 3, device="mgpu", dtype=torch.float64)
    y = torch.zeros_like(x)
    before = torch_mgpu.pending_ops()
    z = (x + y).t()
    assert torch_mgpu.pending_ops() > before
    assert z.shape == (3, 2) and z.dtype == torch.float64 and z.device.type == "mgpu"
    assert z.stride() == (1, 3)
    assert torch_mgpu.pending_ops() > before  # metadata ran nothing


def test_device_index_out_of_range():
    with pytest.raises((RuntimeError, IndexError), match="out of range"):
        torch.randn(3, device="mgpu:5")
    with pytest.raises((RuntimeError, IndexError), match="out of range"):
        torch.randn(3).to("mgpu:3")


def test_mixing_with_cpu_tensor_refused_like_eager():
    a = torch.randn(3, 3, device="mgpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(a, torch.randn(3, 3))
    # Eager allows CPU 0-dim tensors beside device tensors: so do we.
    s = torch.tensor(2.0)
    b = torch.randn(3, 3)
    torch.testing.assert_close((b.to("mgpu") * s).cpu(), b * s)


def test_unsupported_dtype_raises_at_the_call():
    with pytest.raises(RuntimeError, match="not implemented for 'Long'|expected a floating"):
        torch.randn(3, dtype=torch.long, device="mgpu")
    a = torch.randn(3, device="mgpu")
    with pytest.raises(RuntimeError):
        a.bitwise_and(a)  # float bitwise: eager refuses at the call


def test_shape_error_at_the_call_with_eager_message():
    a = torch.randn(3, 4, device="mgpu")
    b = torch.randn(5, 6, device="mgpu")
    with pytest.raises(RuntimeError) as mgpu_err:
        a @ b
    with pytest.raises(RuntimeError) as cpu_err:
        a.cpu() @ b.cpu()
    assert str(cpu_err.value).split("\n")[0] in str(mgpu_err.value)


def test_generator_and_seed_module_functions():
    torch.mgpu.manual_seed(3)
    s = torch.mgpu.get_rng_state()
    a = torch.randn(4, device="mgpu").cpu()
    torch.mgpu.set_rng_state(s)
    b = torch.randn(4, device="mgpu").cpu()
    assert torch.equal(a, b)


def test_module_to_keeps_parameter_objects_and_ties():
    # As on CUDA: module.to("mgpu") moves each Parameter in place, so weights
    # tied across modules stay tied and an optimizer made before the move
    # steps the moved tensors.
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 6)
    head = torch.nn.Linear(6, 10, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model.to("mgpu")
    assert [p is q for p, q in zip(model.parameters(), params)] == [True] * len(params)
    assert model["head"].weight is model["emb"].weight
    assert model["emb"].weight.device.type == "mgpu"
    idx = torch.tensor([1, 4, 7])
    for m, o, dev in ((model, opt, "mgpu"), (ref, ref_opt, "cpu")):
        for _ in range(3):
            o.zero_grad()
            loss = m["head"](m["emb"](idx.to(dev))).logsumexp(-1).sum()
            loss.backward()
            o.step()
    torch.testing.assert_close(model["emb"].weight.cpu(), ref["emb"].weight.detach())
    model.to("cpu")
    assert model["head"].weight is model["emb"].weight and model["emb"].weight is params[0]
    assert model["emb"].weight.device.type == "cpu"
