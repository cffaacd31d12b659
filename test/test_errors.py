"""Failures: errors at the call as eager raises them; a failure during
execution surfaces at the sync point and leaves every tensor usable."""

import pytest
from conftest import run_in_threads
import torch

import torch_mgpu


def test_data_dependent_error_surfaces_at_sync_and_tensors_stay_usable():
    x_cpu = torch.randn(5, 3)
    x = x_cpu.to("mgpu")
    other = (x * 2).sum(0)  # independent work in the same graph
    bad_index = torch.tensor([0, 9]).to("mgpu")
    y = x.index_select(0, bad_index)  # out of range: only the data says so
    with pytest.raises((IndexError, RuntimeError), match="out of range|index"):
        torch_mgpu.synchronize()
    # The independent result computed; the failed one raises again, clearly.
    torch.testing.assert_close(other.cpu(), (x_cpu * 2).sum(0))
    with pytest.raises(RuntimeError, match="lost|out of range|index"):
        y.cpu()
    # Inputs are untouched and later work on them runs.
    assert torch.equal(x.cpu(), x_cpu)
    assert torch.equal((x + 1).cpu(), x_cpu + 1)


def test_failed_inplace_leaves_tensor_as_before():
    base_cpu = torch.randn(4, 2)
    base = base_cpu.to("mgpu")
    keep = base * 1  # a second reader: the write cannot reuse the bytes
    base.index_add_(0, torch.tensor([7]).to("mgpu"), torch.ones(1, 2, device="mgpu"))
    with pytest.raises((IndexError, RuntimeError)):
        torch_mgpu.synchronize()
    assert torch.equal(base.cpu(), base_cpu)
    assert torch.equal(keep.cpu(), base_cpu)
    base.add_(1)
    assert torch.equal(base.cpu(), base_cpu + 1)


def capture_in_threads(n_threads, steps, size, scale=1.0):
    """Each thread records its own chain on mgpu and checks it against eager."""

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(size, size, generator=g)
        x = a.to("mgpu")
        for _ in range(steps):
            x = torch.tanh(x @ x.t() * scale) + 0.5
            a = torch.tanh(a @ a.t() * scale) + 0.5
        torch.testing.assert_close(x.cpu(), a)

    run_in_threads(work, n_threads)


def test_threads_capture_at_once():
    capture_in_threads(4, steps=20, size=32)


def test_bad_inputs_raise_clear_errors():
    a = torch.randn(2, 3, device="mgpu")
    with pytest.raises(RuntimeError, match="shape|size"):
        a.view(4, 4)
    with pytest.raises(IndexError):
        a[5]
    with pytest.raises(RuntimeError):
        a.expand(3, 3, 4)


def test_a_tensor_with_no_data_is_refused_as_eager_refuses_it():
    # A meta tensor has no values: copying it to mgpu raises eager's error
    # for copying it to the CPU, and the mgpu tensor copied into is unharmed.
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        torch.empty(3, device="meta").to("cpu")
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        torch.empty(3, device="meta").to("mgpu")
    x = torch.randn(3)
    m = x.to("mgpu")
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        m.copy_(torch.empty(3, device="meta"))
    assert torch.equal(m.cpu(), x)


@pytest.mark.parametrize("size,stride,offset", [((2, 2), (1, 2), 10), ((20,), (1,), 0), ((3,), (5,), 0),
                                                 ((2,), (1,), 9)])
def test_view_past_its_storage_raises_eagers_error(size, stride, offset):
    # Meta kernels accept any as_strided geometry; the bytes are only 10 floats.
    x_cpu = torch.randn(10)
    x = (x_cpu.to("mgpu") + 0)  # a pending value, as views usually are
    with pytest.raises(RuntimeError) as eager:
        x_cpu.as_strided(size, stride, offset)
    with pytest.raises(RuntimeError) as lazy:
        x.as_strided(size, stride, offset)
    assert str(lazy.value) == str(eager.value)
    assert torch.equal(x.cpu(), x_cpu)


@pytest.mark.parametrize("size,stride,offset", [((2, 2), (1, 2), 5), ((0,), (1,), 100), ((10,), (1,), 0),
                                                 ((2,), (4,), 5)])
def test_views_inside_the_storage_are_fine(size, stride, offset):
    x_cpu = torch.randn(10)
    x = x_cpu.to("mgpu") + 0
    assert torch.equal(x.as_strided(size, stride, offset).cpu(), x_cpu.as_strided(size, stride, offset))
    assert torch.equal(x[2:].as_strided(size[:1], stride[:1], min(offset, 8)).cpu(),
                       x_cpu[2:].as_strided(size[:1], stride[:1], min(offset, 8)))


DROPPED_RESULTS = (
    "x = torch.randn(3, device='mgpu')\n"
    "ints = torch.tensor([4, 5], device='mgpu')\n"
    "a = torch.tensor([[1.0, 2.0], [2.0, 1.0]], device='mgpu')  # not positive-definite\n"
    "calls = {'index': lambda: torch.index_select(x, 0, torch.tensor([0, 7], device='mgpu')),\n"
    "         'floor_divide': lambda: ints // torch.zeros(2, dtype=torch.long, device='mgpu'),\n"
    "         'cholesky': lambda: torch.linalg.cholesky(a)}\n"
    "for name, call in calls.items():\n"
    "    try:\n"
    "        call()  # the result is dropped at once\n"
    "        torch_mgpu.synchronize()\n"
    "        print(name, 'no error')\n"
    "    except Exception as e:\n"
    "        kind = 'LinAlgError' if isinstance(e, torch.linalg.LinAlgError) else type(e).__name__\n"
    "        print(name, kind)\n")


@pytest.mark.parametrize("sync", ["lazy", "op"])
def test_errors_of_results_dropped_before_the_sync(sync):
    # Lazy semantics (README, "Differences from eager"): an op whose result
    # is dropped before the sync never runs, so its data-dependent error
    # never comes; TORCH_MGPU_SYNC=op runs each op at its call, and every
    # error comes there, as eager's.
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    env.pop("TORCH_MGPU_SYNC", None)
    if sync == "op":
        env["TORCH_MGPU_SYNC"] = "op"
    out = subprocess.run([sys.executable, "-c", "import torch, torch_mgpu\n" + DROPPED_RESULTS],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = dict(line.split(" ", 1) for line in out.stdout.strip().split("\n"))
    if sync == "lazy":
        assert got == {"index": "no error", "floor_divide": "no error", "cholesky": "no error"}, got
    else:
        assert got == {"index": "IndexError", "floor_divide": "RuntimeError", "cholesky": "LinAlgError"}, got


INTERRUPTED_META = """
import warnings
import torch, torch_mgpu
warnings.simplefilter("ignore")  # overriding a registered Meta kernel warns
mode = {"raise": None}
lib = torch.library.Library("aten", "IMPL")
def meta(a, b):
    if mode["raise"] is not None:
        raise mode["raise"]
    return torch.empty_like(a)
lib.impl("logaddexp", meta, "Meta")
# New sizes each time: a Meta result of the same signature is cached.
for n, stop in ((4, None), (5, KeyboardInterrupt()), (6, RuntimeError("meta refuses")), (7, SystemExit(3))):
    mode["raise"] = stop
    a, b = torch.randn(n), torch.randn(n)
    try:
        y = torch.logaddexp(a.to("mgpu"), b.to("mgpu"))
        print(n, torch.allclose(y.cpu(), torch.logaddexp(a, b)))
    except BaseException as e:
        print(n, type(e).__name__)
"""


def test_a_keyboard_interrupt_in_a_python_meta_kernel_stops_the_program():
    # A SIGINT while Python code runs under a call (a Meta kernel written in
    # Python: LSTM's cell) raises KeyboardInterrupt there; the call must not
    # take it as the Meta kernel refusing the call and rerun the op on the
    # CPU (which went on as if nothing happened: an LSTM double backward
    # ignored SIGINT). A Python Meta kernel's own error still gives the CPU
    # rerun, with no Python error left pending.
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_META], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:4] == ["4 True", "5 KeyboardInterrupt", "6 True", "7 SystemExit"], out.stdout
