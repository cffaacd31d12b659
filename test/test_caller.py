"""An error raised at a sync names the line that recorded the failing op
("called at file.py:12"): the innermost frame outside torch's and mgpu's own
files. On CPython 3.11 a call site met before is named without taking the
GIL back (stats()["callers_without_gil"]); these check that the line named
is the right one wherever that path answers: the same line in a loop, two
lines taking turns, through torch's own Python frames, in a generator, in
another thread."""
import inspect
import re
import sys
import threading

import pytest
import torch

import torch_mgpu

FAST_PATH = sys.version_info[:2] == (3, 11)


def not_positive_definite(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 4, generator=g, dtype=torch.float64)
    return -(a @ a.mT) - torch.eye(4, dtype=torch.float64)  # negative definite


def named_line(error):
    m = re.search(r"called at (.*):(\d+)\)", str(error))
    assert m, f"no caller in: {error}"
    return m.group(1), int(m.group(2))


def raise_at_sync(t):
    with pytest.raises(torch.linalg.LinAlgError) as e:
        t.cpu()
    return named_line(e.value)


def here():
    return inspect.currentframe().f_back.f_lineno


def test_the_same_line_in_a_loop_is_named_each_time():
    m = not_positive_definite().to("mgpu")
    before = torch_mgpu.stats()["callers_without_gil"]
    for _ in range(6):
        line = here() + 1
        L = torch.linalg.cholesky(m)
        assert raise_at_sync(L) == (__file__, line)
    gained = torch_mgpu.stats()["callers_without_gil"] - before
    if FAST_PATH:
        assert gained >= 5, "a call site met before took the GIL"
    else:
        assert gained == 0


def test_two_lines_taking_turns_are_told_apart():
    m = not_positive_definite(1).to("mgpu")
    for i in range(6):
        if i % 2:
            line = here() + 1
            L = torch.linalg.cholesky(m)
        else:
            line = here() + 1
            L = torch.linalg.cholesky(m, upper=True)
        assert raise_at_sync(L) == (__file__, line)


def test_an_op_called_by_torchs_own_python_names_the_users_line():
    cov = not_positive_definite(2).to("mgpu")
    loc = torch.zeros(4, dtype=torch.float64).to("mgpu")
    for _ in range(4):
        line = here() + 1
        d = torch.distributions.MultivariateNormal(loc, covariance_matrix=cov, validate_args=False)
        assert raise_at_sync(d.scale_tril) == (__file__, line)


def test_ops_recorded_in_a_generator_name_its_line():
    m = not_positive_definite(3).to("mgpu")
    line = None

    def factors():
        nonlocal line
        for _ in range(4):
            line = here() + 1
            yield torch.linalg.cholesky(m)

    for L in factors():
        assert raise_at_sync(L) == (__file__, line)


def test_another_thread_names_its_own_line():
    m = not_positive_definite(4).to("mgpu")
    seen, errors = [], []

    def work():
        try:
            for _ in range(4):
                line = here() + 1
                L = torch.linalg.cholesky(m)
                seen.append((raise_at_sync(L), (__file__, line)))
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    assert len(seen) == 4
    for got, want in seen:
        assert got == want
    # and this thread, after it, still its own
    line = here() + 1
    L = torch.linalg.cholesky(m)
    assert raise_at_sync(L) == (__file__, line)
