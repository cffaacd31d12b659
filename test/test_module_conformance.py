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


def test_a_cached_plan_does_not_write_in_place_a_value_another_node_reads():
    # Graphs of one structure share a plan; which reads share a
    # materialized value is part of that structure. Here the first graphs'
    # copy_ is the one reader of its operand (its plan writes it in place);
    # the last graph's mul reads that operand too, and runs after the copy.
    # (gradcheck of nn.Transformer perturbs parameters this way: half its
    # numerical derivatives read the restored weight.)
    def leaves():
        return [torch.randn(64, 64).to("mgpu") for _ in range(3)]

    for _ in range(3):
        x, u, z = leaves()
        torch_mgpu.synchronize()
        t = u * 2
        x.copy_(z)
        w = t + 1
        del t
        w.cpu()
    x, _, z = leaves()
    torch_mgpu.synchronize()
    want = x.cpu() * 2 + 1
    t = x * 2
    x.copy_(z)
    w = t + 1
    del t
    assert torch.equal(w.cpu(), want)
    assert torch.equal(x.cpu(), z.cpu())


def test_transformer_gradcheck_with_masks():
    # test_modules' test_grad_nn_Transformer, module_db's sample 32
    # (norm_first, boolean masks, unbatched): fast gradcheck over the inputs
    # and every parameter, which perturbs each through `.data` in turn.
    from torch.testing._internal.common_modules import module_db

    info = next(m for m in module_db if m.module_cls is torch.nn.Transformer)
    torch.manual_seed(0)
    sample = info.module_inputs_func(info, device="mgpu", dtype=torch.float64, requires_grad=True, training=True)[32]
    kwargs = sample.constructor_input.kwargs
    assert kwargs["norm_first"] and kwargs["dropout"] == 0.0
    m = info.module_cls(*sample.constructor_input.args, **kwargs).to("mgpu", torch.float64)
    args = sample.forward_input.args
    masks = {k: v for k, v in sample.forward_input.kwargs.items() if isinstance(v, torch.Tensor)}
    assert set(masks) == {"src_mask", "tgt_mask"}
    params = tuple(m.parameters())

    def fn(*inputs):
        return m(*inputs[: len(args)], **masks)

    assert torch.autograd.gradcheck(fn, args + params, fast_mode=True)


def test_gather_with_a_sparse_gradient_is_refused_at_the_call():
    x = torch.randn(3, 4, requires_grad=True)
    idx = torch.tensor([[0, 1], [2, 3], [1, 1]])
    xm = x.detach().to("mgpu").requires_grad_()
    with pytest.raises(NotImplementedError, match=r"gather\(\.\.\., sparse_grad=True\).*sparse_grad=False"):
        torch.gather(xm, 1, idx.to("mgpu"), sparse_grad=True)
    # The way out named: the same gradient, dense.
    torch.gather(xm, 1, idx.to("mgpu")).sum().backward()
    torch.gather(x, 1, idx, sparse_grad=True).sum().backward()
    assert torch.equal(xm.grad.cpu(), x.grad.to_dense())
    # Without a gradient, sparse_grad changes nothing.
    with torch.no_grad():
        got = torch.gather(xm, 1, idx.to("mgpu"), sparse_grad=True)
    assert torch.equal(got.cpu(), torch.gather(x.detach(), 1, idx))
    got = torch.gather(xm.detach(), 1, idx.to("mgpu"), sparse_grad=True)
    assert torch.equal(got.cpu(), torch.gather(x.detach(), 1, idx))


@pytest.mark.parametrize("module", ["Embedding", "EmbeddingBag"])
def test_embeddings_with_sparse_gradients_are_refused_at_the_call(module):
    torch.manual_seed(2)
    kwargs = {"mode": "sum"} if module == "EmbeddingBag" else {}
    idx = torch.tensor([[1, 2], [3, 1]])
    for sparse in (False, True):
        m = getattr(torch.nn, module)(10, 3, sparse=sparse, **kwargs)
        mm = getattr(torch.nn, module)(10, 3, sparse=sparse, **kwargs)
        mm.load_state_dict(m.state_dict())
        mm.to("mgpu")
        with torch.no_grad():  # no gradient: the flag changes nothing
            assert torch.equal(mm(idx.to("mgpu")).cpu(), m(idx))
        m(idx).sum().backward()
        if sparse:
            name = "embedding_bag" if module == "EmbeddingBag" else "embedding"
            with pytest.raises(NotImplementedError, match=rf"mgpu: {name}\(\.\.\., sparse=True\).*sparse=False"):
                mm(idx.to("mgpu"))
        else:
            mm(idx.to("mgpu")).sum().backward()
            assert torch.equal(mm.weight.grad.cpu(), m.weight.grad)


LSTM_GRADGRAD = """
import faulthandler, signal
# A process started with SIGINT ignored (a background job of a
# non-interactive shell, as a CI script's may be) keeps it ignored: Python
# installs its handler only over the default.
# Each SIGINT is counted: the first must stop the run (one that Python
# code under a call took for an error would leave the run going).
sigints = []
def on_sigint(signum, frame):
    sigints.append(signum)
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, on_sigint)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, if a SIGINT goes unanswered
import torch, torch_mgpu, sys
from torch.testing._internal.common_modules import module_db
from torch.testing._internal.common_utils import gradgradcheck
info = next(m for m in module_db if m.module_cls is torch.nn.LSTM)
torch.manual_seed(0)
samples = info.module_inputs_func(info, device="mgpu", dtype=torch.float64, requires_grad=True, training=False)
print("start", flush=True)
try:
    for k in range(int(sys.argv[1])):
        s = samples[k % len(samples)]
        m = info.module_cls(*s.constructor_input.args, **s.constructor_input.kwargs).to("mgpu", torch.float64).eval()
        flat, spec = torch.utils._pytree.tree_flatten(s.forward_input.args + tuple(m.parameters()))
        n = len(s.forward_input.args)
        def fn(*xs):
            return torch.utils._pytree.tree_flatten(m(*torch.utils._pytree.tree_unflatten(xs, spec)[:n]))[0]
        assert gradgradcheck(fn, flat)
    print("done", flush=True)
except KeyboardInterrupt:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's next ones, while this exits
    print("interrupted", len(sigints), flush=True)
"""


def test_lstm_double_backward_finishes():
    # test_modules' test_gradgrad_nn_LSTM_{eval,train}_mode: gradgradcheck
    # over module_db's LSTM samples (two layers, projections, both
    # directions) runs to the end.
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", LSTM_GRADGRAD, "4"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split() == ["start", "done"], out.stderr[-2000:]


def test_lstm_double_backward_stops_at_a_sigint():
    # A SIGINT lands where Python code runs on the main thread: LSTM's
    # cell's Meta kernel (Python), gradcheck, or compiled code's wrapper in
    # a tier-1 run. Its KeyboardInterrupt was taken for the kernel refusing
    # the call (the op ran again on the CPU) or for the compiled code
    # failing (tier 0 ran the graph): the run went on. test_errors.py and
    # test_tiers.py have those two cases; here the whole run stops.
    import signal
    import subprocess
    import sys
    import time
    child = subprocess.Popen([sys.executable, "-c", LSTM_GRADGRAD, "64"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "start"
        time.sleep(3)  # well into the checks
        for _ in range(240):  # a SIGINT a second until it exits (one must do)
            child.send_signal(signal.SIGINT)
            try:
                out, err = child.communicate(timeout=1)
                break
            except subprocess.TimeoutExpired:
                pass
        else:
            raise subprocess.TimeoutExpired(child.args, 240)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGUSR1)  # the child's Python stacks
        time.sleep(2)
        child.kill()
        out, err = child.communicate()
        raise AssertionError("no exit after 240 SIGINTs, a second apart:\n" + err[-6000:])
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0 and out.split() == ["interrupted", "1"], (out, err[-2000:])