"""torch.autocast("mgpu"): the ops CPU autocast casts, cast the same way, with
CPU autocast's results (dtypes and values)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_mgpu  # noqa: F401


def test_the_same_ops_are_registered_as_for_cpu_autocast():
    cpu = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
    mgpu = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastPrivateUse1"))
    assert cpu and cpu == mgpu


def rand(*shape):
    return torch.randn(*shape, generator=GEN)


GEN = torch.Generator().manual_seed(0)

# (name, function of CPU tensors, its inputs): lower precision, fp32 and
# promote policies, and ops autocast leaves alone.
CASES = [
    ("mm", lambda a, b: a @ b, lambda: (rand(8, 16), rand(16, 4))),
    ("linear", lambda x, w, b: F.linear(x, w, b), lambda: (rand(5, 6), rand(3, 6), rand(3))),
    ("conv2d", lambda x, w: F.conv2d(x, w, padding=1), lambda: (rand(2, 3, 8, 8), rand(4, 3, 3, 3))),
    ("bmm_then_add", lambda a, b: torch.bmm(a, b) + 1, lambda: (rand(2, 4, 5), rand(2, 5, 3))),
    ("mse_loss", lambda a, b: F.mse_loss(a @ a.t(), b), lambda: (rand(4, 4), rand(4, 4))),
    ("cross_entropy", lambda x, w, t: F.cross_entropy(x @ w, t), lambda: (rand(6, 5), rand(5, 3), torch.randint(0, 3, (6,), generator=GEN))),
    ("cat_promote", lambda a, b: torch.cat([a @ a, b]), lambda: (rand(3, 3), rand(2, 3))),
    ("stack_promote", lambda a, b: torch.stack([a @ a, b]), lambda: (rand(3, 3), rand(3, 3))),
    ("prod_fp32", lambda a: torch.prod(a @ a, 1), lambda: (rand(4, 4),)),
    ("untouched", lambda a: (a.tanh() * 2).softmax(0), lambda: (rand(7),)),
    ("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), lambda: (rand(1, 2, 4, 8), rand(1, 2, 4, 8), rand(1, 2, 4, 8))),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,fn,make", CASES, ids=[c[0] for c in CASES])
def test_results_equal_cpu_autocast(name, fn, make, dtype):
    args = make()
    with torch.autocast("cpu", dtype=dtype):
        want = fn(*args)
    with torch.autocast("mgpu", dtype=dtype):
        got = fn(*[a.to("mgpu") for a in args])
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_outside_the_region_nothing_is_cast():
    a = rand(4, 4)
    with torch.autocast("mgpu", dtype=torch.bfloat16):
        inside = a.to("mgpu") @ a.to("mgpu")
        with torch.autocast("mgpu", enabled=False):
            off = a.to("mgpu") @ a.to("mgpu")
    after = a.to("mgpu") @ a.to("mgpu")
    assert inside.dtype == torch.bfloat16
    assert off.dtype == after.dtype == torch.float32
    assert torch.equal(after.cpu(), a @ a)


def test_cpu_tensors_inside_an_mgpu_region_are_left_to_cpu_autocast():
    a = rand(4, 4)
    with torch.autocast("mgpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.float32


def test_training_with_grad_scaler_matches_cpu():
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mgpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mgpu_model.load_state_dict(cpu_model.state_dict())
    mgpu_model.to("mgpu")
    x, target = rand(32, 8), rand(32, 4)
    for device, model, inp, tgt in [("cpu", cpu_model, x, target), ("mgpu", mgpu_model, x.to("mgpu"), target.to("mgpu"))]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                loss = F.mse_loss(model(inp).float(), tgt)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    for p_cpu, p_mgpu in zip(cpu_model.parameters(), mgpu_model.parameters()):
        torch.testing.assert_close(p_mgpu.detach().cpu(), p_cpu.detach(), rtol=1e-5, atol=1e-6)


def test_an_unsupported_dtype_warns_and_disables_autocast_as_cuda_does():
    a = rand(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("mgpu", dtype=torch.float64):
            y = a.to("mgpu") @ a.to("mgpu")
    assert any("not supported" in str(w.message) for w in caught)
    assert y.dtype == torch.float32
