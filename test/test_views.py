"""Views and in-place ops give eager's results: each case runs the same code
on CPU and on mgpu and compares every tensor involved."""
import pytest
import torch

import torch_mgpu
from conftest import assert_same


def both(fn, *shapes, seed=0):
    """Runs fn(*tensors) on CPU and on mgpu copies; returns both outputs and inputs."""
    g = torch.Generator().manual_seed(seed)
    cpu = [torch.randn(*s, generator=g) for s in shapes]
    mg = [t.to("mgpu") for t in cpu]
    out_cpu = fn(*cpu)
    out_mg = fn(*mg)
    return cpu, mg, out_cpu, out_mg


def check(fn, *shapes):
    cpu, mg, oc, om = both(fn, *shapes)
    for a, b in zip(mg, cpu):
        assert_same(a, b)
    if oc is not None:
        oc = oc if isinstance(oc, (tuple, list)) else [oc]
        om = om if isinstance(om, (tuple, list)) else [om]
        for a, b in zip(om, oc):
            assert_same(a, b)


CASES = {
    "slice_iadd": (lambda x: x[1:].add_(1), (4, 3)),
    "setitem_slice": (lambda x: x.__setitem__((slice(None), 1), 7.0), (4, 3)),
    "transpose_mul_": (lambda x: x.transpose(0, 1).mul_(2), (3, 5)),
    "view_then_base_change": (lambda x: (x.view(-1), x.add_(3))[0], (2, 6)),
    "chained_views": (lambda x: x.t()[1:, ::2].unsqueeze(0).sub_(5), (6, 7)),
    "select_fill": (lambda x: x.select(1, 2).fill_(0.5), (4, 4)),
    "diagonal_zero": (lambda x: x.diagonal().zero_(), (5, 5)),
    "expand_read": (lambda x: x[:1].expand(4, 3) * 2, (4, 3)),
    "narrow_copy_": (lambda x, y: x.narrow(0, 1, 2).copy_(y[:2]), (5, 3), (4, 3)),
    "out_variant": (lambda x, y: torch.add(x, y, out=x), (3, 3), (3, 3)),
    "out_resized": (lambda x, y: torch.mm(x, y, out=torch.empty(0, device=x.device)), (3, 4), (4, 2)),
    "unbind_inplace": (lambda x: [t.mul_(i) for i, t in enumerate(x.unbind(0))], (3, 4)),
    "split_chunk": (lambda x: [c.add_(1) for c in x.chunk(3, dim=1)], (2, 6)),
    "reshape_view_write": (lambda x: x.reshape(3, 4).t().contiguous().add_(1), (12,)),
    "aliasing_self_add": (lambda x: x.add_(x), (4,)),
    "overlapping_views": (lambda x: x[:-1].add_(x[1:].clone()), (6,)),
    "as_strided_write": (lambda x: x.as_strided((2, 2), (1, 2), 1).mul_(10), (6,)),
    "index_put": (lambda x: x.index_put_((torch.tensor([0, 2]).to(x.device),), torch.tensor(9.0).to(x.device)), (4, 2)),
    "masked_fill_view": (lambda x: x[1:].masked_fill_(x[1:] > 0, -1.0), (4, 3)),
    "resize_grow": (lambda x: x.resize_(5, 5).shape, (2, 2)),
    "detach_shares": (lambda x: x.detach().mul_(3), (3,)),
    "unsqueeze_inplace": (lambda x: x.unsqueeze_(0), (3, 2)),
    "t_inplace": (lambda x: x.t_(), (3, 2)),
    "clamp_inplace_view": (lambda x: x[::2].clamp_(-0.1, 0.1), (7,)),
    "dtype_view": (lambda x: x.view(torch.int32).bitwise_and_(0x7FFFFFFF), (5,)),
    "scatter_": (lambda x: x.scatter_(0, torch.tensor([[0, 1, 2]]).to(x.device), 5.0), (3, 3)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_view_inplace(name):
    fn, *shapes = CASES[name]
    if name == "resize_grow":
        cpu, mg, oc, om = both(fn, *shapes)
        assert oc == om
        assert_same(mg[0].flatten()[:4], cpu[0].flatten()[:4])  # the old bytes survive growth
        return
    check(fn, *shapes)


def test_view_sees_later_base_write():
    x_cpu = torch.randn(4, 4)
    x = x_cpu.to("mgpu")
    v, vc = x[1], x_cpu[1]
    x.mul_(2)
    x_cpu.mul_(2)
    assert_same(v, vc)
    v.add_(1)
    vc.add_(1)
    assert_same(x, x_cpu)


def test_inplace_returns_same_tensor():
    x = torch.randn(3, device="mgpu")
    y = x.add_(1)
    assert y is x
    z = torch.add(x, 1, out=x)
    assert z is x


def test_copy_between_devices_and_dtypes():
    src = torch.randn(3, 4)
    dst = torch.zeros(3, 4, dtype=torch.float64, device="mgpu")
    dst.copy_(src)
    assert_same(dst, src.double())
    back = torch.empty(3, 4)
    back.copy_(dst)
    assert torch.equal(back, src.double().float())
    bcast = torch.zeros(2, 3, 4, device="mgpu")
    bcast[1].copy_(src)
    expected = torch.zeros(2, 3, 4)
    expected[1] = src
    assert_same(bcast, expected)


def test_storage_shared_between_views_is_one_storage():
    x = torch.randn(4, 4, device="mgpu")
    v = x.t()
    assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert v._is_view() and v._base is x


def test_set_rebinds_storage_like_eager():
    a_cpu = torch.randn(6)
    a = a_cpu.to("mgpu")
    b = torch.empty(0, device="mgpu")
    b.set_(a.untyped_storage(), 1, (2, 2), (2, 1))
    bc = torch.empty(0).set_(a_cpu.untyped_storage(), 1, (2, 2), (2, 1))
    assert_same(b, bc)
    a.add_(1)  # b aliases a's storage, as on CPU
    a_cpu.add_(1)
    assert_same(b, bc)
    c = torch.empty(0, device="mgpu").set_(a)
    assert_same(c, a_cpu)
    d = torch.randn(3, device="mgpu").set_()
    assert d.shape == (0,)
    with pytest.raises(RuntimeError, match="out of bounds"):
        torch.empty(0, device="mgpu").set_(a.untyped_storage(), 0, (10,), (1,))
    with pytest.raises(RuntimeError, match="devices must match"):
        torch.empty(0, device="mgpu").set_(torch.randn(3))


def test_save_load_deepcopy_and_storage_copies():
    import copy
    import io
    m = torch.nn.Linear(4, 3).to("mgpu")
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, map_location="cpu")
    assert torch.equal(sd["weight"], m.weight.cpu())
    m2 = copy.deepcopy(m)
    assert m2.weight.device.type == "mgpu" and torch.equal(m2.weight.cpu(), m.weight.cpu())
    with torch.no_grad():
        m2.weight.add_(1)  # a deep copy is independent
    assert not torch.equal(m2.weight.cpu(), m.weight.cpu())
    s = m.weight.untyped_storage().cpu()
    assert s.nbytes() == m.weight.nbytes
