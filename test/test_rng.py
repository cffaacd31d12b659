"""mgpu's generator through torch.mgpu and PyTorch's seeding functions:
manual_seed(_all), seed(_all), initial_seed, get/set_rng_state(_all), and
torch.random.fork_rng over the mgpu device."""
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
