"""Streams on mgpu (torch.mgpu.Stream, torch.Stream("mgpu"), torch.mgpu.stream):
each has its own id and a thread has a current stream, as on CUDA; work is
ordered by its data, so results never depend on streams (code written for
CUDA streams computes what eager code computes, with or without events)."""
import threading

import torch

import torch_mgpu
from conftest import assert_same, restore_lanes, same_values


def test_streams_have_their_own_ids_and_a_current_stream_per_thread():
    s1, s2 = torch.mgpu.Stream(), torch.Stream("mgpu")
    assert isinstance(s1, torch.Stream) and s1.device == torch.device("mgpu", 0)
    assert s1 != s2 and s1.stream_id != s2.stream_id
    default = torch.mgpu.default_stream()
    assert torch.mgpu.current_stream() == default == torch.accelerator.current_stream()
    seen_elsewhere = []
    with torch.mgpu.stream(s1):
        assert torch.mgpu.current_stream() == s1
        t = threading.Thread(target=lambda: seen_elsewhere.append(torch.mgpu.current_stream()))
        t.start()
        t.join()
        with s2:  # torch.Stream is a context manager too
            assert torch.accelerator.current_stream() == s2
        assert torch.mgpu.current_stream() == s1
    assert torch.mgpu.current_stream() == default
    assert seen_elsewhere == [default]
    torch.mgpu.set_stream(s2)
    try:
        assert torch.mgpu.current_stream() == s2
    finally:
        torch.mgpu.set_stream(default)
    with torch.mgpu.stream(None):  # None: no change, as torch.cuda.stream(None)
        assert torch.mgpu.current_stream() == default


def test_cuda_style_stream_code_computes_what_eager_computes():
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    xm = x.to("mgpu")
    side, other = torch.mgpu.Stream(), torch.mgpu.Stream()
    with torch.mgpu.stream(side):
        a = xm @ xm
        ready = torch.mgpu.Event()
        ready.record()
    with torch.mgpu.stream(other):
        other.wait_event(ready)
        b = a.relu() + 1
        xm.mul_(2)  # an in-place write on a stream: later readers see it
    torch.mgpu.current_stream().wait_stream(other)
    c = b.sum(0) + xm[0]
    xe = x.clone()
    ae = xe @ xe
    be = ae.relu() + 1
    xe.mul_(2)
    assert_same(a, ae)
    assert_same(b, be)
    assert_same(c, be.sum(0) + xe[0])


def test_without_events_results_still_follow_the_data():
    # On CUDA this is a race (no event between the streams); on mgpu the
    # order of the data decides.
    x = torch.randn(32, 32)
    xm = x.to("mgpu")
    s1, s2 = torch.mgpu.Stream(), torch.mgpu.Stream()
    with torch.mgpu.stream(s1):
        y = xm.sin()
        xm.add_(1)
    with torch.mgpu.stream(s2):
        z = y * xm
    assert_same(z, x.sin() * (x + 1))


def test_stream_synchronize_and_query_run_what_is_pending():
    x = torch.randn(16, 16).to("mgpu")
    s = torch.mgpu.Stream()
    with torch.mgpu.stream(s):
        y = x @ x
    assert torch_mgpu.pending_ops() > 0
    s.synchronize()
    assert torch_mgpu.pending_ops() == 0
    assert s.query()
    assert y.device.type == "mgpu"


def test_d2l_two_runs_with_no_sync_between_them_run_in_parallel():
    # The seed's d2l code (two runs of matrix products, then a synchronize),
    # written for mgpu: the two runs share no data, so they take both lanes.
    # (HEFT: the "auto" policy may instead give one lane both cores' threads
    # when the products are small enough for that to be as fast.)
    before, policy = torch_mgpu.lanes(), torch_mgpu.policy()
    torch_mgpu.configure(policy="heft")
    try:
        _two_runs()
    finally:
        restore_lanes(before, policy)


def _two_runs():
    torch.manual_seed(0)

    def run(x):
        return [x.mm(x) for _ in range(8)]

    x1 = torch.rand(160, 160, device="mgpu")
    x2 = torch.rand(160, 160, device="mgpu")
    torch.mgpu.synchronize()
    r1 = run(x1)
    r2 = run(x2)
    torch.mgpu.synchronize()
    plan = torch_mgpu.last_plan()
    assert plan.lanes_used >= 2  # both, of 2 CPU lanes; of a GPU's 4 streams, more
    lane_of = {e["lane"] for e in plan.timeline()}
    assert len(lane_of) == plan.lanes_used
    x1c, x2c = x1.cpu(), x2.cpu()
    for r in r1:
        assert same_values(r.cpu(), x1c.mm(x1c))
    for r in r2:
        assert same_values(r.cpu(), x2c.mm(x2c))
