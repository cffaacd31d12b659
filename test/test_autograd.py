"""Autograd on mgpu: backward records lazily, grads live on mgpu, and real
torch.nn modules train step for step like on CPU."""
import copy

import pytest
import torch

import torch_mgpu
from conftest import CUDA_LANES_TOLERANCE, on_cuda_lanes, run_in_threads


def test_backward_is_lazy_and_grads_on_mgpu():
    w_cpu = torch.randn(8, 4, requires_grad=True)
    w = w_cpu.detach().to("mgpu").requires_grad_()
    x_cpu = torch.randn(5, 8)
    x = x_cpu.to("mgpu")
    loss = torch.tanh(x @ w).pow(2).mean()
    torch_mgpu.synchronize()
    loss.backward()
    assert torch_mgpu.pending_ops() > 0  # the backward ops are recorded, not run
    assert w.grad.device.type == "mgpu"
    torch.tanh(x_cpu @ w_cpu).pow(2).mean().backward()
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)


class Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # No conv bias before batch norm: its gradient is rounding noise,
        # which Adam would amplify into an arbitrary sign.
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(6)
        self.fc = torch.nn.Linear(6 * 8 * 8, 10)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(self.drop(x.flatten(1)))


MODELS = {
    "mlp": (lambda: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                        torch.nn.Linear(32, 3)), (16, 8), "ce"),
    "conv_bn": (Tower, (4, 3, 8, 8), "ce"),
    "lstm": (lambda: torch.nn.LSTM(6, 12, batch_first=True), (3, 5, 6), "mse"),
    "gru": (lambda: torch.nn.GRU(6, 12, num_layers=2), (5, 3, 6), "mse"),
    "transformer_layer": (lambda: torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                          (2, 5, 16), "mse"),
}


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_module_trains_like_cpu(model_name, opt_name):
    make, shape, loss_kind = MODELS[model_name]
    torch.manual_seed(0)
    ref = make()
    mg = copy.deepcopy(ref).to("mgpu")
    assert all(p.device.type == "mgpu" for p in mg.parameters())
    make_opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                # eps well above float rounding: parallel lanes may sum in another
                # order than eager (fewer threads per op), and Adam would blow
                # that last-bit noise in near-zero gradients up to lr-sized steps.
                "adam": lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-3)}[opt_name]
    o_ref, o_mg = make_opt(ref.parameters()), make_opt(mg.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(*shape, generator=g)
        for model, opt, dev in [(ref, o_ref, "cpu"), (mg, o_mg, "mgpu")]:
            opt.zero_grad()
            out = model(x.to(dev))
            out = out[0] if isinstance(out, tuple) else out
            if loss_kind == "ce":
                target = torch.arange(out.shape[0]).remainder(out.shape[1]).to(dev)
                loss = torch.nn.functional.cross_entropy(out, target)
            else:
                loss = out.pow(2).mean()
            loss.backward()
            opt.step()
            if dev == "cpu":
                ref_loss = loss.item()
            else:
                assert abs(loss.item() - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss))
    for p_ref, p_mg in zip(ref.parameters(), mg.parameters()):
        torch.testing.assert_close(p_mg.cpu(), p_ref, rtol=1e-4, atol=1e-5)
        assert p_mg.grad.device.type == "mgpu"
    for b_ref, b_mg in zip(ref.buffers(), mg.buffers()):
        torch.testing.assert_close(b_mg.cpu(), b_ref, rtol=1e-4, atol=1e-5)


def test_no_grad_and_detach():
    x = torch.randn(3, device="mgpu", requires_grad=True)
    with torch.no_grad():
        y = x * 2
    assert not y.requires_grad
    z = (x * 3).detach()
    assert not z.requires_grad
    (x * x).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * x.detach().cpu())


def test_grad_accumulates():
    w = torch.randn(4, device="mgpu", requires_grad=True)
    for _ in range(3):
        (w * 2).sum().backward()
    assert torch.equal(w.grad.cpu(), torch.full((4,), 6.0))


@pytest.mark.parametrize("norm", ["batch_norm", "batch_norm_eval", "conv_batch_norm"])
def test_gradients_of_a_first_layer_whose_input_needs_none(norm):
    # The backward kernels return no input gradient then (output_mask), where
    # the recorded op's Meta kernel gave one: the parameters' gradients come
    # out as eager's.
    torch.manual_seed(3)
    if norm == "conv_batch_norm":
        ref = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
        x = torch.randn(2, 3, 6, 6)
    else:
        ref = torch.nn.Sequential(torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
        x = torch.randn(8, 5) * 2 + 1
    if norm == "batch_norm_eval":
        ref.eval()
    mg = copy.deepcopy(ref).to("mgpu")
    ref(x).square().sum().backward()
    mg(x.to("mgpu")).square().sum().backward()
    # (The convolution's bias has a gradient of zero but for rounding, which a
    # GPU's kernels round otherwise: 5e-6 against eager CPU's on an H100.)
    tolerance = CUDA_LANES_TOLERANCE if on_cuda_lanes() else dict(rtol=1e-5, atol=1e-6)
    for p_ref, p_mg in zip(ref.parameters(), mg.parameters()):
        torch.testing.assert_close(p_mg.grad.cpu(), p_ref.grad, **tolerance)


def _hooked_thread(t, seen):
    """A hook on `t` that notes the thread its gradient is computed on and
    whether autograd's multithreading was on there."""
    import threading

    def hook(grad):
        seen.append((threading.get_ident(), torch._C._is_multithreading_enabled()))
    t.register_hook(hook)


@pytest.mark.parametrize("how", ["backward", "grad", "host loss"])
def test_the_backward_of_an_mgpu_graph_runs_on_the_calling_thread(how):
    """Autograd runs a device's nodes on a thread of its own; an mgpu
    graph's run on the thread that called backward (torch_mgpu/_backward.py:
    a second thread's kernels would start an OpenMP team of their own, and
    with more OpenMP threads than cores every kernel pays for waking its
    team), also under a loss computed on the host. The gradients are
    eager's, and the setting is the program's again afterwards."""
    import threading
    g = torch.Generator().manual_seed(31)
    w_cpu = torch.randn(12, 6, generator=g, requires_grad=True)
    x_cpu = torch.randn(9, 12, generator=g)
    w = w_cpu.detach().to("mgpu").requires_grad_()
    seen = []
    h = torch.tanh(x_cpu.to("mgpu") @ w)
    _hooked_thread(h, seen)
    loss = (h.cpu() ** 2).sum() if how == "host loss" else (h * h).sum()
    h_cpu = torch.tanh(x_cpu @ w_cpu)
    loss_cpu = (h_cpu * h_cpu).sum()
    if how == "grad":
        (got,) = torch.autograd.grad(loss, [w])
        (want,) = torch.autograd.grad(loss_cpu, [w_cpu])
    else:
        loss.backward()
        loss_cpu.backward()
        got, want = w.grad, w_cpu.grad
    assert seen == [(threading.get_ident(), False)]
    torch.testing.assert_close(got.cpu(), want)
    assert torch._C._is_multithreading_enabled()


def test_which_backwards_run_on_the_calling_thread():
    """The rule of torch_mgpu/_backward.py: mgpu roots or inputs, tensors or
    GradientEdges (keyword arguments too), or any backward where no CUDA
    device is present (a host root may stand over an mgpu graph)."""
    from torch.autograd.graph import get_gradient_edge
    from torch_mgpu import _backward
    x = torch.randn(3, requires_grad=True)
    xm = x.detach().to("mgpu").requires_grad_()
    assert _backward._mgpu_value(xm) and not _backward._mgpu_value(x)
    assert _backward._mgpu_value(get_gradient_edge(xm * 2))
    assert not _backward._mgpu_value(get_gradient_edge(x * 2))
    saved = _backward._no_cuda
    try:
        _backward._no_cuda = False  # as on a machine with a CUDA device
        assert _backward._reaches_mgpu((xm.sum(),), ())
        assert _backward._reaches_mgpu((x.sum(),), (xm,))
        assert not _backward._reaches_mgpu((x.sum(),), (x,))
        _backward._no_cuda = True
        assert _backward._reaches_mgpu((x.sum(),), ())
    finally:
        _backward._no_cuda = saved
    # The engine's keyword form.
    from torch.autograd.variable import Variable
    (gx,) = Variable._execution_engine.run_backward(
        tensors=((xm * xm).sum(),), grad_tensors=(torch.ones((), device="mgpu"),), keep_graph=False, create_graph=False,
        inputs=(xm,), allow_unreachable=False, accumulate_grad=False)
    torch.testing.assert_close(gx.cpu(), 2 * x.detach())


def test_mgpu_backwards_from_several_threads_each_give_eagers_gradients():
    """Each thread's backward runs on that thread, side by side."""
    g = torch.Generator().manual_seed(33)
    ws = [torch.randn(16, 8, generator=g) for _ in range(4)]
    xs = [torch.randn(10, 16, generator=g) for _ in range(4)]
    got = [None] * 4

    def work(i):
        for _ in range(5):
            w = ws[i].to("mgpu").requires_grad_()
            torch.relu(xs[i].to("mgpu") @ w).pow(2).mean().backward()
        got[i] = w.grad.cpu()
    run_in_threads(work, 4)
    for i in range(4):
        w = ws[i].clone().requires_grad_()
        torch.relu(xs[i] @ w).pow(2).mean().backward()
        torch.testing.assert_close(got[i], w.grad)


def test_an_error_in_an_mgpu_backward_leaves_the_setting_as_it_was():
    from torch.autograd.variable import Variable
    from torch_mgpu import _backward
    assert isinstance(Variable._execution_engine, _backward._Engine)
    w = torch.randn(5, 3).to("mgpu").requires_grad_()
    h = w * 3
    during = []

    def fail(grad):
        during.append(torch._C._is_multithreading_enabled())
        raise ValueError("a hook that fails")
    h.register_hook(fail)
    with pytest.raises(ValueError, match="a hook that fails"):
        h.sum().backward()
    assert during == [False]
    assert torch._C._is_multithreading_enabled()
    # The engine's other entries are PyTorch's own.
    assert Variable._execution_engine.is_checkpoint_valid()
