"""Lazy capture and materialization: ops stay pending until a sync point."""
import copy
import gc
import resource
import sys
import weakref

import pytest
import torch

import torch_mgpu
from conftest import assert_same, same_values


def pending_after(fn):
    torch_mgpu.synchronize()
    keep = fn()
    return torch_mgpu.pending_ops(), keep


def test_issue_example():
    torch.manual_seed(0)
    a_cpu = torch.randn(64, 64)
    a = a_cpu.to("mgpu")
    b = torch.randn(64, 64, device="mgpu")
    c = (a @ b).relu() + a.sum(dim=0)
    assert torch_mgpu.pending_ops() >= 3
    assert c.shape == (64, 64) and c.dtype == torch.float32 and c.device.type == "mgpu"
    b_cpu = b.cpu()
    torch.testing.assert_close(c.cpu(), (a_cpu @ b_cpu).relu() + a_cpu.sum(dim=0))
    assert torch_mgpu.pending_ops() == 0


@pytest.mark.parametrize("trigger", ["cpu", "to", "item", "tolist", "print", "bool", "synchronize", "numpy"])
def test_sync_triggers(trigger, capsys):
    # Multiples of 1/8: the sum is exact in any order (a GPU lane sums in
    # another order than the CPU, and randn's values differed in the last
    # bit there), so every trigger can compare exactly.
    x_cpu = torch.randint(-64, 64, (4,)).float() / 8 + 0.125
    x = x_cpu.to("mgpu")
    y = (x * 2).sum()
    assert torch_mgpu.pending_ops() > 0
    expected = (x_cpu * 2).sum()
    if trigger == "cpu":
        assert torch.equal(y.cpu(), expected)
    elif trigger == "to":
        assert torch.equal(y.to("cpu"), expected)
    elif trigger == "item":
        assert y.item() == expected.item()
    elif trigger == "tolist":
        assert (x * 2).tolist() == (x_cpu * 2).tolist()
    elif trigger == "print":
        print(y)
        assert str(expected)[:-1] + ", device='mgpu:0')" in capsys.readouterr().out
    elif trigger == "bool":
        assert bool(y > -1e9)
    elif trigger == "synchronize":
        torch_mgpu.synchronize()
    elif trigger == "numpy":
        assert y.cpu().numpy() == expected.numpy()
    assert torch_mgpu.pending_ops() == 0


def test_the_phases_of_a_sync_are_timed():
    before = torch_mgpu.stats()
    x = torch.randn(64, device="mgpu")
    for _ in range(300):
        x = torch.tanh(x * 1.5)
    x.cpu()
    after = torch_mgpu.stats()
    for phase in ("graph", "plan", "execute", "bind", "report"):
        key = f"sync_{phase}_us"
        assert after[key] >= before[key], key
    assert after["sync_execute_us"] > before["sync_execute_us"]
    assert after["sync_graph_us"] + after["sync_report_us"] > before["sync_graph_us"] + before["sync_report_us"]


def test_pending_graph_limit_triggers_sync():
    old = torch_mgpu.max_pending_ops()
    torch_mgpu.set_max_pending_ops(50)
    try:
        x = torch.randn(8, device="mgpu")
        syncs = torch_mgpu.stats()["syncs"]
        for _ in range(200):
            x = x + 1
            assert torch_mgpu.pending_ops() <= 51
        assert torch_mgpu.stats()["syncs"] >= syncs + 3
    finally:
        torch_mgpu.set_max_pending_ops(old)
    with pytest.raises(RuntimeError, match="positive"):
        torch_mgpu.set_max_pending_ops(0)


def test_to_copies_like_eager():
    src = torch.randn(5)
    m = src.to("mgpu")
    src.add_(100)  # mutating the source afterwards must not reach the copy
    assert_same(m, src - 100, exact=False)
    back = m.cpu()
    back.add_(1)  # and .cpu() copies too
    assert not torch.equal(back, m.cpu())


def test_dead_code_elimination():
    x = torch.randn(32, 32, device="mgpu")
    torch_mgpu.synchronize()
    executed = torch_mgpu.stats()["ops_executed"]
    keep = x @ x
    dropped = (x @ x).exp().sin()  # noqa: F841
    del dropped
    keep.cpu()
    assert torch_mgpu.stats()["ops_executed"] - executed == 1


def test_metadata_cache_hits_on_repeat():
    x = torch.randn(16, 16, device="mgpu")
    (x @ x).relu()
    hits = torch_mgpu.stats()["meta_cache_hits"]
    (x @ x).relu()
    assert torch_mgpu.stats()["meta_cache_hits"] >= hits + 2


def test_a_scale_that_changes_every_call_hits_the_metadata_cache():
    # An optimizer's update scales a term by the learning rate (SGD's
    # add_(alpha=-lr), Adam's addcdiv_(value=-step_size)): a new float each
    # step. The signature keys such a scale by its class (0, 1, other), so
    # the calls hit; the values are each call's own.
    a, b, c = torch.randn(6, 5), torch.randn(6, 5), torch.rand(6, 5) + 0.5
    am, bm, cm = a.to("mgpu"), b.to("mgpu"), c.to("mgpu")
    scales = [0.3, -1.7, 0.0, 1.0, 2.5e-4, -0.3, 7.0]
    got, want = [], []
    for k, s in enumerate(scales):
        if k == 2:
            misses = torch_mgpu.stats()["meta_cache_misses"]
        got += [am.add(bm, alpha=s), am.sub(bm, alpha=s), torch.addcdiv(am, bm, cm, value=s),
                torch.addcmul(am, bm, cm, value=s), torch.rsub(am, bm, alpha=s)]
        want += [a.add(b, alpha=s), a.sub(b, alpha=s), torch.addcdiv(a, b, c, value=s),
                 torch.addcmul(a, b, c, value=s), torch.rsub(a, b, alpha=s)]
        if k == len(scales) - 1:
            # From the third call on only 0 and 1 (classes of their own) missed.
            assert torch_mgpu.stats()["meta_cache_misses"] == misses + 10
    for g, w in zip(got, want):
        assert same_values(g.cpu(), w)
    # In place, as an optimizer writes: every step hits once the classes were seen.
    p, pm = a.clone(), a.to("mgpu")
    for s in [1e-3, 2e-3, 3e-3, 0.0, 1.0, 4e-3]:
        p.addcdiv_(b, c, value=-s)
        pm.addcdiv_(bm, cm, value=-s)
        p.add_(b, alpha=-s)
        pm.add_(bm, alpha=-s)
    assert torch.equal(pm.cpu(), p)
    # A scale beyond what the tensor's dtype holds is eager's error at the
    # call, whatever smaller scales did before.
    h = torch.randn(4).half().to("mgpu")
    assert torch.equal(h.add(h, alpha=0.5).cpu(), h.cpu().add(h.cpu(), alpha=0.5))
    with pytest.raises(RuntimeError, match="cannot be converted to type c10::Half without overflow"):
        h.add(h, alpha=1e5)
    with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
        am.add(bm, alpha=1e39)
    # The scale's type still counts: a float scale of integer tensors is
    # eager's error, whatever an integer scale did before.
    i = torch.arange(6, device="mgpu")
    assert torch.equal(i.add(i, alpha=2).cpu(), torch.arange(6) * 3)
    with pytest.raises(RuntimeError, match="alpha must not be a floating point number"):
        i.add(i, alpha=2.5)


def test_calls_leave_their_arguments_reference_counts_as_they_found_them():
    # The commonest ops are called unboxed, their tensor arguments on the
    # recording's stack without references of their own: on every way out of
    # a call (recorded, refused, run eagerly, in place, called boxed) the
    # counts are back where they were, and a dropped tensor dies.
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    am, bm = a.to("mgpu"), b.to("mgpu")
    counts = (am._use_count(), bm._use_count(), sys.getrefcount(am), sys.getrefcount(bm))
    s = am + bm
    r = (am * 2).relu().sub(bm, alpha=0.5)
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        am + torch.randn(3, device="mgpu")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(am, bm)
    nz = torch.nonzero(am > 0)
    assert am.add_(bm) is am
    p = torch.ops.aten.mul.Tensor(am, bm)
    assert (am._use_count(), bm._use_count(), sys.getrefcount(am), sys.getrefcount(bm)) == counts
    assert_same(s, a + b)
    assert_same(r, (a * 2).relu().sub(b, alpha=0.5))
    assert_same(nz, torch.nonzero(a > 0))
    a.add_(b)
    assert_same(am, a)
    assert_same(p, a * b)
    dropped = weakref.ref(am)
    del am
    assert dropped() is None


def rss_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_no_memory_growth_over_many_cycles():
    x = torch.randn(256, 256, device="mgpu")
    def cycle():
        y = x
        for _ in range(10):
            y = torch.tanh(y @ x) + 1
        return y.sum().item()
    for _ in range(20):
        cycle()
    # The hot graph's background compile (tier 1) loads the compiler once:
    # done before the measure, whose cycles then run its compiled code.
    torch_mgpu.wait_for_compiles()
    for _ in range(20):
        cycle()
    gc.collect()
    before = rss_kib()
    for _ in range(200):
        cycle()
    gc.collect()
    growth_mib = (rss_kib() - before) / 1024
    assert growth_mib < 20, f"max RSS grew {growth_mib:.1f} MiB over 200 capture/sync cycles"
    assert torch_mgpu.pending_ops() == 0


def test_graph_memory_released_after_execution():
    import weakref
    x = torch.randn(128, 128, device="mgpu")
    y = (x @ x).relu()
    torch_mgpu.synchronize()
    # After the sync, y's storage holds bytes, not a graph: nothing pending
    # and a second sync runs nothing.
    executed = torch_mgpu.stats()["ops_executed"]
    torch_mgpu.synchronize()
    y.cpu()
    assert torch_mgpu.stats()["ops_executed"] == executed
    assert torch_mgpu.pending_ops() == 0


def test_empty_then_fill_and_uninitialized_read():
    e = torch.empty(3, 4, device="mgpu")
    assert e.cpu().shape == (3, 4)
    e.fill_(2.5)
    assert torch.equal(e.cpu(), torch.full((3, 4), 2.5))


def test_empty_factories_are_made_with_no_inference_and_eagers_geometry():
    """torch.empty and empty_strided as most calls make them (strided, not
    pinned, contiguous or given strides) are made directly: neither a Meta
    inference nor a node. Their sizes, strides and dtypes are eager's, and
    the calls this does not take (a memory format, pinned memory, a negative
    size) get eager's results and errors from the recording."""
    torch_mgpu.synchronize()
    before = torch_mgpu.stats()
    made = [torch.empty(3, 4, device="mgpu"), torch.empty((), device="mgpu"), torch.empty(0, 5, device="mgpu"),
            torch.empty(2, 3, dtype=torch.int16, device="mgpu"), torch.empty_strided((2, 3), (1, 2), device="mgpu"),
            torch.empty_strided((4, 1, 3), (3, 7, 1), dtype=torch.float64, device="mgpu")]
    after = torch_mgpu.stats()
    assert after["meta_cache_hits"] + after["meta_cache_misses"] == \
        before["meta_cache_hits"] + before["meta_cache_misses"]
    assert torch_mgpu.pending_ops() == 0
    ref = [torch.empty(3, 4), torch.empty(()), torch.empty(0, 5), torch.empty(2, 3, dtype=torch.int16),
           torch.empty_strided((2, 3), (1, 2)), torch.empty_strided((4, 1, 3), (3, 7, 1), dtype=torch.float64)]
    for m, r in zip(made, ref):
        assert (m.shape, m.stride(), m.dtype, m.storage_offset()) == (r.shape, r.stride(), r.dtype, r.storage_offset())
        assert m.untyped_storage().nbytes() == r.untyped_storage().nbytes()
        m.fill_(1.5)
        assert torch.equal(m.cpu(), torch.full_like(r, 1.5))
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert torch.empty(2, device="mgpu").dtype == torch.float64
    finally:
        torch.set_default_dtype(saved)
    cl = torch.empty(2, 3, 4, 5, device="mgpu", memory_format=torch.channels_last)
    assert cl.stride() == torch.empty(2, 3, 4, 5, memory_format=torch.channels_last).stride()
    x = torch.randn(3, 4, device="mgpu").t()
    assert torch.empty_like(x).stride() == torch.empty_like(x.cpu()).stride()
    assert x.new_empty(5).shape == (5,)
    with pytest.raises(RuntimeError, match="negative dimension"):
        torch.empty(2, -1, device="mgpu")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.empty(2, device="mgpu:7")
    with pytest.raises(RuntimeError, match="overflow"):
        torch.empty(2**62, 2**62, device="mgpu")
    import warnings
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert torch.empty(2, dtype=torch.complex32, device="mgpu").dtype == torch.complex32


def test_dtypes_and_conversions():
    a = torch.arange(10, device="mgpu")
    assert a.dtype == torch.int64
    assert torch.equal(a.cpu(), torch.arange(10))
    b = a.to(torch.float16) / 3
    torch.testing.assert_close(b.cpu(), torch.arange(10).to(torch.float16) / 3)
    c = (a > 4)
    assert c.dtype == torch.bool and c.cpu().tolist() == (torch.arange(10) > 4).tolist()


def test_data_dependent_ops_run_eagerly():
    x_cpu = torch.randn(20)
    x = x_cpu.to("mgpu")
    nz = torch.nonzero(x > 0)
    assert nz.device.type == "mgpu"
    assert torch.equal(nz.cpu(), torch.nonzero(x_cpu > 0))
    ms = x[x > 0]
    assert torch.equal(ms.cpu(), x_cpu[x_cpu > 0])
    u = torch.unique(torch.tensor([3, 1, 3, 2]).to("mgpu"))
    assert u.cpu().tolist() == [1, 2, 3]


def test_batch_norm_updates_its_running_statistics_when_its_output_is_dropped():
    # native_batch_norm writes running_mean and running_var without its
    # schema saying so: the write must be a recorded one, or a forward whose
    # output nobody reads (torch.optim.swa_utils.update_bn) updates nothing
    # and a read recorded after it may run before it.
    torch.manual_seed(0)
    ref = torch.nn.BatchNorm1d(6)
    mg = copy.deepcopy(ref).to("mgpu")
    x = torch.randn(32, 6) * 3 + 1
    with torch.no_grad():
        ref(x)
        mg(x.to("mgpu"))
    assert_same(mg.running_mean, ref.running_mean)
    assert_same(mg.running_var, ref.running_var)
    out = mg(x.to("mgpu"))
    read = mg.running_var * 2
    want = ref(x)
    assert_same(read, ref.running_var * 2)
    assert_same(out, want)
    assert mg.num_batches_tracked.item() == ref.num_batches_tracked.item() == 2
    # The functional form, and eval mode (which reads the statistics only).
    rm, rv = torch.zeros(6).to("mgpu"), torch.ones(6).to("mgpu")
    rm_ref, rv_ref = torch.zeros(6), torch.ones(6)
    torch.nn.functional.batch_norm(x.to("mgpu"), rm, rv, training=True, momentum=0.3)
    torch.nn.functional.batch_norm(x, rm_ref, rv_ref, training=True, momentum=0.3)
    assert_same(rm, rm_ref)
    assert_same(rv, rv_ref)
    # The out= form.
    outs = [torch.empty(32, 6), torch.empty(6), torch.empty(6)]
    outs_m = [t.to("mgpu") for t in outs]
    torch.ops.aten.native_batch_norm.out(x, None, None, rm_ref, rv_ref, True, 0.5, 1e-5, out=outs[0],
                                         save_mean=outs[1], save_invstd=outs[2])
    torch.ops.aten.native_batch_norm.out(x.to("mgpu"), None, None, rm, rv, True, 0.5, 1e-5, out=outs_m[0],
                                         save_mean=outs_m[1], save_invstd=outs_m[2])
    for got, want in zip([rm, rv] + outs_m, [rm_ref, rv_ref] + outs):
        assert_same(got, want)
    mg.eval()
    ref.eval()
    assert_same(mg(x.to("mgpu")), ref(x))
    assert_same(mg.running_mean, ref.running_mean)


def test_every_counter_is_a_key_of_stats():
    # Counters are declared once (runtime/counters.h, TORCH_MGPU_COUNTERS):
    # each is a key of stats(), beside the values stats() reads elsewhere.
    import os
    import re
    header = open(os.path.join(os.path.dirname(__file__), "..", "csrc", "runtime", "counters.h")).read()
    listed = re.findall(r"^\s*X\((\w+)\)", header, re.M)
    assert len(listed) == len(set(listed)) > 30
    assert set(torch_mgpu.stats()) == set(listed) | {"pending_ops", "host_cache_bytes", "host_cache_hits"}
