"""torch.save / torch.load of mgpu tensors, modules, optimizer state and
whole checkpoints, with every kind of map_location and weights_only, against
the same program on CPU."""
import copy
import io

import pytest
import torch

import torch_mgpu


def roundtrip(obj, **load_kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


MAP_LOCATIONS = {
    "none": (None, "mgpu"),
    "mgpu": ("mgpu", "mgpu"),
    "mgpu:0": (torch.device("mgpu:0"), "mgpu"),
    "cpu": ("cpu", "cpu"),
    "function": (lambda storage, loc: storage, "cpu"),
    "dict": ({"mgpu:0": "cpu"}, "cpu"),
}


@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize("where", sorted(MAP_LOCATIONS))
def test_tensors_views_and_pending_values(where, weights_only):
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    xm = x.to("mgpu")
    ym = torch.tanh(xm @ xm.t())  # pending: computed before it is saved
    assert torch_mgpu.pending_ops() > 0
    map_location, device = MAP_LOCATIONS[where]
    got = roundtrip({"x": xm, "y": ym, "row": ym[1], "t": xm.t()}, map_location=map_location,
                    weights_only=weights_only)
    y = torch.tanh(x @ x.t())
    for key, want in (("x", x), ("y", y), ("row", y[1]), ("t", x.t())):
        assert got[key].device.type == device, key
        assert torch.equal(got[key].cpu(), want), key
    # Views still share their storage after loading, as they did when saved.
    got["y"].add_(1)
    assert torch.equal(got["row"].cpu(), y[1] + 1)
    assert torch.equal(got["t"].cpu(), x.t())


def test_loading_onto_mgpu_records_no_op():
    xm = torch.randn(64, 64).to("mgpu")
    buf = io.BytesIO()
    torch.save({"x": xm, "xs": [xm * 2, xm[3:]]}, buf)
    torch_mgpu.synchronize()
    before = torch_mgpu.stats()
    buf.seek(0)
    got = torch.load(buf)
    after = torch_mgpu.stats()
    assert after["ops_captured"] == before["ops_captured"]
    assert torch_mgpu.pending_ops() == 0
    assert got["x"].device.type == "mgpu"
    assert torch.equal(got["xs"][1].cpu(), xm[3:].cpu())


def make_model():
    # (No bias feeds the batch norm: its gradient would be rounding noise,
    # which Adam scales up to full steps.)
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def train(model, opt, xs, ys, device):
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
    return loss.item()


@pytest.mark.parametrize("weights_only", [False, True])
def test_checkpoint_resume_matches_cpu(weights_only, tmp_path):
    torch.manual_seed(2)
    xs = [torch.randn(12, 8) for _ in range(6)]
    ys = [torch.randint(0, 3, (12,)) for _ in range(6)]
    # CPU reference: 3 steps, checkpoint, 3 more.
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    train(ref, ref_opt, xs[:3], ys[:3], "cpu")
    ref_loss = train(ref, ref_opt, xs[3:], ys[3:], "cpu")
    # mgpu: 3 steps, save the whole checkpoint to a file, load it into a new
    # model and optimizer, 3 more.
    model = make_model().to("mgpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, xs[:3], ys[:3], "mgpu")
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": 3}, path)
    ckpt = torch.load(path, weights_only=weights_only)
    assert ckpt["step"] == 3
    assert ckpt["model"]["0.weight"].device.type == "mgpu"
    assert ckpt["opt"]["state"][0]["exp_avg"].device.type == "mgpu"
    resumed = make_model().to("mgpu")
    resumed.load_state_dict(ckpt["model"])
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(ckpt["opt"])
    loss = train(resumed, resumed_opt, xs[3:], ys[3:], "mgpu")
    assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-5)
    for (name, p), q in zip(resumed.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p.cpu(), q, msg=name)
    # The same checkpoint onto CPU.
    cpu_ckpt = torch.load(path, map_location="cpu", weights_only=weights_only)
    cpu_model = make_model()
    cpu_model.load_state_dict(cpu_ckpt["model"])
    assert all(p.device.type == "cpu" for p in cpu_model.state_dict().values())


def test_whole_module_pickled():
    model = make_model().to("mgpu").eval()
    x = torch.randn(5, 8)
    got = roundtrip(copy.deepcopy(model), weights_only=False)
    assert next(got.parameters()).device.type == "mgpu"
    torch.testing.assert_close(got(x.to("mgpu")).cpu(), model.cpu()(x))


def test_device_context_and_bad_index():
    with torch.mgpu.device(0), torch.mgpu.device("mgpu:0"), torch.mgpu.device(torch.device("mgpu")):
        pass
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
        torch.mgpu.device(1)
    with pytest.raises(ValueError, match="Expected an mgpu device"):
        torch.mgpu.device("cpu")
    buf = io.BytesIO()
    torch.save(torch.randn(2).to("mgpu"), buf)
    buf.seek(0)
    with pytest.raises(RuntimeError, match="device_count"):
        torch.load(buf, map_location="mgpu:3")
