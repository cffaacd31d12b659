"""Random ops are deterministic under torch.manual_seed."""
import pytest
import torch

import torch_mgpu


def draw():
    a = torch.randn(6, device="mgpu")
    b = torch.rand(3, 3, device="mgpu")
    c = torch.empty(5, device="mgpu").uniform_(-2, 2)
    d = torch.nn.functional.dropout(torch.ones(50, device="mgpu"), 0.5, training=True)
    e = torch.randint(0, 10, (8,), device="mgpu")
    f = torch.randperm(7, device="mgpu")
    g = torch.bernoulli(torch.full((10,), 0.3, device="mgpu"))
    return [t.cpu() for t in (a, b, c, d, e, f, g)]


def test_manual_seed_repeats():
    torch.manual_seed(123)
    first = draw()
    torch.manual_seed(123)
    second = draw()
    for x, y in zip(first, second):
        assert torch.equal(x, y)
    torch.manual_seed(124)
    third = draw()
    assert not torch.equal(first[0], third[0])


def test_seeded_results_do_not_depend_on_sync_points():
    torch.manual_seed(5)
    a = torch.randn(4, device="mgpu")
    b = torch.randn(4, device="mgpu")
    ref = (a.cpu(), b.cpu())
    torch.manual_seed(5)
    a2 = torch.randn(4, device="mgpu")
    torch_mgpu.synchronize()  # a sync between the draws changes nothing
    b2 = torch.randn(4, device="mgpu")
    assert torch.equal(a2.cpu(), ref[0]) and torch.equal(b2.cpu(), ref[1])


def test_mgpu_draws_leave_cpu_generator_alone():
    torch.manual_seed(9)
    expected = torch.randn(5)
    torch.manual_seed(9)
    x = torch.nn.functional.dropout(torch.ones(100, device="mgpu"), 0.5, training=True)
    x.cpu()
    assert torch.equal(torch.randn(5), expected)


def test_dropout_values_are_a_mask():
    torch.manual_seed(0)
    x = torch.nn.functional.dropout(torch.ones(1000, device="mgpu"), 0.25, training=True).cpu()
    assert set(x.unique().tolist()) <= {0.0, torch.tensor(1.0 / 0.75).item()}
    assert 150 < (x == 0).sum().item() < 350


def test_explicit_generator():
    g = torch.Generator(device="mgpu")
    g.manual_seed(77)
    a = torch.randn(5, device="mgpu", generator=g).cpu()
    g.manual_seed(77)
    b = torch.randn(5, device="mgpu", generator=g).cpu()
    assert torch.equal(a, b)


@pytest.mark.parametrize("at_call", ["off", "on"])
def test_checking_random_calls_undoes_no_draw_of_another_thread(at_call):
    # The first call of each signature is checked on CPU. A call passing no
    # generator drew from the default CPU generator there, whose state was
    # then put back: a CPU draw another thread made meanwhile was undone,
    # and that thread got the same numbers twice. So did running such a
    # call (rand, randint.low) lazily or at the call, with the default
    # generator seeded for it: its overload that takes a generator is
    # called with one of its own.
    saved = torch_mgpu._C._at_call()
    torch_mgpu.synchronize()
    torch_mgpu.configure(at_call=at_call)
    try:
        _draws_beside_random_calls()
    finally:
        torch_mgpu.synchronize()
        torch_mgpu._C._set_at_call(saved)


def _draws_beside_random_calls():
    import threading
    n_draws = 20000
    torch.manual_seed(11)
    want = torch.rand(n_draws)
    torch.manual_seed(11)
    got = []
    started, done = threading.Event(), threading.Event()

    def draws():
        started.wait(60)
        for _ in range(n_draws):
            got.append(torch.rand(1))
        done.set()

    def records():
        n = 1
        while not done.is_set():
            torch.rand(n, device="mgpu")  # a new signature each time
            torch.empty(n + 1, device="mgpu").normal_()
            torch.randint(0, 5, (n,), device="mgpu")
            torch.randperm(20000 + n, device="mgpu")  # a long draw
            n += 1
            started.set()
        torch_mgpu.synchronize()

    threads = [threading.Thread(target=records), threading.Thread(target=draws)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    got = torch.cat(got)
    assert int((got[1:] == got[:-1]).sum()) == 0
    assert torch.equal(got, want)
