"""Differential fuzzing against eager CPU (test/difffuzz.py): random programs
of views, in-place and out= ops, indexing, dtype promotion, reductions,
matmul, autograd and syncs run on CPU and on mgpu under each lane
configuration, every statement's outcome compared, on fixed seeds. A longer
run: `bash scripts/dev.sh fuzz [SECONDS]`."""
import contextlib
import io

import torch

import torch_mgpu
import difffuzz
from difffuzz import Program, Stmt

SEEDS = range(200)


def test_fixed_seeds_match_eager():
    # On a mismatch the first program of each group is shrunk (10 s in all)
    # and the failure message holds the reproducers.
    report = difffuzz.fuzz(SEEDS, minimize_budget_s=5, minimize_total_s=10)
    assert report.ok, "\n" + report.summary()


def test_programs_are_deterministic():
    assert difffuzz.generate(3).source() == difffuzz.generate(3).source()
    assert difffuzz.generate(3).source() != difffuzz.generate(4).source()


def test_cpu_runs_agree_with_themselves():
    # The harness compares nothing that varies between two identical runs.
    for seed in range(20):
        prog = difffuzz.generate(seed)
        assert difffuzz.compare(prog, difffuzz.run(prog, "cpu"), difffuzz.run(prog, "cpu")) == []


def test_configurations_are_restored():
    state = (torch_mgpu.configuration(), torch_mgpu.async_ops())
    for cfg in difffuzz.CONFIGS:
        with difffuzz.configured(cfg):
            assert torch_mgpu.async_ops() == cfg.async_ops
            assert len(torch_mgpu.lanes()) == len(cfg.devices) * cfg.lanes_per_device
    assert (torch_mgpu.configuration(), torch_mgpu.async_ops()) == state


def ancestors(prog, i):
    """Statement i and those that define what it reads, transitively."""
    need, keep = set(prog.uses[i]), {i}
    for j in range(i - 1, -1, -1):
        if set(prog.defs[j]) & need:
            keep.add(j)
            need |= prog.uses[j]
    return sorted(keep)


def test_shrinking_keeps_what_a_statement_needs():
    # A failure that needs one statement shrinks to it and its producers.
    for seed in range(5):
        prog = difffuzz.generate(seed)
        i = max(range(len(prog)), key=lambda k: (len(ancestors(prog, k)), k))
        target = prog.stmts[i].src
        small = difffuzz.shrink(prog, lambda p: any(st.src == target for st in p.stmts))
        assert [st.src for st in small.stmts] == [prog.stmts[k].src for k in ancestors(prog, i)]


def test_reproducers_run():
    prog = Program(0, [Stmt("v0 = torch.arange(6.0, device=dev).view(2, 3)", "input"),
                       Stmt("v1 = v0.t().abs()", "unary.abs"),
                       Stmt("v2 = v0[torch.tensor([5], device=dev)]", "error.index_bounds")])
    cfg = difffuzz.CONFIGS[0]
    value = difffuzz.Mismatch(1, "v1", "value", "unary.abs", "(for the test)")
    error = difffuzz.Mismatch(2, None, "deferred error", "error.index_bounds", "(for the test)")
    for m in (value, error):
        src = difffuzz.render(prog, m, cfg)
        out = io.StringIO()
        with difffuzz.configured(cfg), contextlib.redirect_stdout(out):
            exec(compile(src, "<reproducer>", "exec"), {"__name__": "__reproducer__"})
        assert "cpu" in out.getvalue()
    assert torch.get_default_dtype() == torch.float32
