"""mgpu's generator through torch.mgpu and PyTorch's seeding functions:
manual_seed(_all), seed(_all), initial_seed, get/set_rng_state(_all), and
torch.random.fork_rng over the mgpu device."""
import os
import subprocess
import sys

import pytest
import torch

import torch_mgpu  # noqa: F401


def draw():
    return torch.randn(64, device="mgpu").cpu()


def test_torch_manual_seed_seeds_mgpu():
    torch.manual_seed(123)
    a = draw()
    torch.manual_seed(123)
    b = draw()
    assert torch.equal(a, b)
    assert torch.mgpu.initial_seed() == 123
    torch.mgpu.manual_seed(7)
    c = draw()
    torch.mgpu.manual_seed_all(7)
    assert torch.equal(draw(), c)
    assert not torch.equal(a, c)


def test_rng_state_round_trip():
    torch.mgpu.manual_seed(5)
    state = torch.mgpu.get_rng_state()
    states = torch.mgpu.get_rng_state_all()
    assert len(states) == torch.mgpu.device_count() and torch.equal(states[0], state)
    first = draw()
    torch.mgpu.set_rng_state(state)
    assert torch.equal(draw(), first)
    torch.mgpu.set_rng_state_all(states)
    assert torch.equal(draw(), first)


def test_seed_and_seed_all_pick_fresh_seeds():
    torch.mgpu.seed()
    s1 = torch.mgpu.initial_seed()
    a = draw()
    torch.mgpu.seed_all()
    s2 = torch.mgpu.initial_seed()
    assert s1 != s2
    torch.mgpu.manual_seed(s1)
    assert torch.equal(draw(), a)


def test_fork_rng_restores_the_mgpu_generator():
    torch.mgpu.manual_seed(11)
    with torch.random.fork_rng(device_type="mgpu"):
        torch.mgpu.manual_seed(99)
        draw()
    after = draw()
    torch.mgpu.manual_seed(11)
    assert torch.equal(draw(), after)


# A fresh process: the cost model is measured once per process, at the first
# plan (a sync, or a background flight).
_FIRST_PLAN = r"""
import sys, torch, torch_mgpu
torch.manual_seed(0)
want = torch.rand(5)
torch.manual_seed(0)
x = torch.ones(4, device="mgpu")
if sys.argv[1] == "flight":
    torch_mgpu.set_async_ops(8)
    for _ in range(40):
        x = x * 1.5
    torch_mgpu._C._wait_for_flight()
else:
    (x + 1).cpu()
got = torch.rand(5)
assert torch.equal(got, want), (got, want)
print("ok")
"""


@pytest.mark.parametrize("first_plan", ["sync", "flight"])
def test_the_first_plan_draws_nothing_from_the_programs_generators(first_plan):
    # The cost model's measurements ran over tensors drawn from the default
    # CPU generator: a program seeded before its first sync drew other
    # numbers after it than without mgpu.
    env = dict(os.environ)
    env.pop("TORCH_MGPU_NO_CALIBRATION", None)
    r = subprocess.run([sys.executable, "-c", _FIRST_PLAN, first_plan], capture_output=True, text=True, env=env,
                       timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
