"""Events on mgpu (torch.mgpu.Event, torch.Event("mgpu")): an event marks
every op recorded before it; it is complete once they have run, and its time
is when the last of them ended on its lane, so elapsed_time is measured lane
time. Querying never runs anything; synchronizing runs what is pending."""
import time

import pytest
import torch

import torch_mgpu
from conftest import async_ops, eager_on_lanes_device, same_values

# What nodes do on the lanes: tier 0, whatever the default (conftest).
pytestmark = pytest.mark.usefixtures("node_by_node")


def chain(x, n):
    for _ in range(n):
        x = (x @ x).tanh()
    return x


def test_query_reports_the_ops_recorded_before_and_polling_ends():
    never = torch.mgpu.Event()
    assert never.query()  # never recorded: nothing to wait for, as on CUDA
    torch_mgpu.synchronize()
    idle = torch.mgpu.Event()
    idle.record()
    assert idle.query()  # nothing was pending
    x = torch.randn(64, 64).to("mgpu")
    y = chain(x, 3)
    e = torch.mgpu.Event()
    e.record()
    # As on a GPU, the work goes on while the host polls: query starts it in
    # the background and a polling loop ends.
    deadline = time.monotonic() + 60
    polls = 0
    while not e.query():
        polls += 1
        assert time.monotonic() < deadline, "an event's query never became true"
    assert torch_mgpu.pending_ops() == 0
    assert same_values(y.cpu(), eager_on_lanes_device(lambda t: chain(t, 3), x.cpu()))


def test_query_and_stream_query_with_background_execution_off_run_the_work():
    with async_ops(0):
        x = torch.randn(32, 32).to("mgpu")
        y = x @ x
        e = torch.mgpu.Event()
        e.record()
        assert e.query() and torch_mgpu.pending_ops() == 0
        z = y.relu()
        assert torch.mgpu.current_stream().query() and torch_mgpu.pending_ops() == 0
        assert same_values(z.cpu(), (x.cpu() @ x.cpu()).relu())


def test_synchronize_of_a_complete_event_runs_nothing_recorded_after_it():
    x = torch.randn(16, 16).to("mgpu")
    torch_mgpu.synchronize()
    e = torch.mgpu.Event()
    e.record()
    later = x @ x
    pending = torch_mgpu.pending_ops()
    e.synchronize()
    assert torch_mgpu.pending_ops() == pending > 0
    assert same_values(later.cpu(), x.cpu() @ x.cpu())


def test_polling_a_stream_ends():
    x = torch.randn(64, 64).to("mgpu")
    y = chain(x, 2)
    s = torch.mgpu.current_stream()
    deadline = time.monotonic() + 60
    while not s.query():
        assert time.monotonic() < deadline, "a stream's query never became true"
    assert torch_mgpu.pending_ops() == 0
    assert same_values(y.cpu(), eager_on_lanes_device(lambda t: chain(t, 2), x.cpu()))


def test_an_event_is_complete_when_what_came_before_it_ran():
    x = torch.randn(64, 64).to("mgpu")
    first = chain(x, 2)
    e = torch.mgpu.Event()
    e.record()
    later = chain(x * 2, 2)  # recorded after the event
    first.cpu()  # a sync runs everything pending
    assert e.query()
    assert later.device.type == "mgpu"


def test_elapsed_time_is_measured_lane_time():
    x = torch.randn(256, 256).to("mgpu")
    torch_mgpu.synchronize()
    start, middle, end = (torch.mgpu.Event(enable_timing=True) for _ in range(3))
    t0 = time.perf_counter()
    start.record()
    a = chain(x, 6)
    middle.record()
    b = chain(a, 6)  # needs a: runs after it
    end.record()
    end.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1000
    plan = torch_mgpu.last_plan()
    to_middle, to_end = start.elapsed_time(middle), start.elapsed_time(end)
    assert 0 < to_middle < to_end <= wall_ms
    # The products ran inside that span: its length is at least the
    # measured time of the nodes that ran.
    busy_ms = sum(e["end"] - e["start"] for e in plan.timeline()) * 1000
    assert to_end >= 0.9 * busy_ms
    assert middle.elapsed_time(end) == pytest.approx(to_end - to_middle)
    assert same_values(b.cpu(), eager_on_lanes_device(lambda t: chain(chain(t, 6), 6), x.cpu()))


def test_elapsed_time_errors_as_on_cuda():
    timed, untimed = torch.mgpu.Event(enable_timing=True), torch.mgpu.Event()
    assert isinstance(timed, torch.mgpu.Event) and isinstance(torch.Event("mgpu"), torch.mgpu.Event)
    assert not isinstance(torch.Event("cpu"), torch.mgpu.Event)
    with pytest.raises(ValueError, match="recorded"):
        timed.elapsed_time(torch.mgpu.Event(enable_timing=True))
    timed.record()
    untimed.record()
    with pytest.raises(ValueError, match="enable_timing"):
        timed.elapsed_time(untimed)
    x = torch.randn(32, 32).to("mgpu")
    y = x @ x
    late = torch.mgpu.Event(enable_timing=True)
    late.record()
    with pytest.raises(RuntimeError, match="complete"):
        timed.elapsed_time(late)
    late.synchronize()
    assert timed.elapsed_time(late) >= 0
    assert y.device.type == "mgpu"


def test_recording_on_another_device_types_stream_raises():
    with pytest.raises(RuntimeError, match="does not match"):
        torch.Event("mgpu").record(torch.Stream("cpu"))


def test_an_event_synchronize_raises_the_error_of_an_op_before_it():
    from torch_mgpu import _C

    with async_ops(0):
        x = torch.randn(4, 4).to("mgpu")
        y = torch.tanh(x)
        e = torch.mgpu.Event()
        e.record()
        _C._inject_fault("node", 1)
        try:
            with pytest.raises(RuntimeError, match="injected fault"):
                e.synchronize()
        finally:
            _C._inject_fault("node", 0)
        assert e.query()
        with pytest.raises(RuntimeError, match="value was lost"):
            y.cpu()


def test_events_recorded_while_background_flights_run():
    with async_ops(16):
        x = torch.randn(64, 64).to("mgpu")
        start = torch.mgpu.Event(enable_timing=True)
        start.record()
        ys = [(x * float(i)).sin() @ x for i in range(40)]  # several flights
        end = torch.mgpu.Event(enable_timing=True)
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) > 0
        xc = x.cpu()
        for i, y in enumerate(ys):
            assert torch.allclose(y.cpu(), (xc * float(i)).sin() @ xc, atol=1e-5)


@pytest.mark.parametrize("between", ["elementwise", "nothing"])
def test_a_query_after_a_settings_change_runs_the_products_under_their_own(between):
    # A query starts pending work in the background, where it runs under the
    # settings as they are. After the program changed the matmul precision
    # (with an elementwise op recorded since, which reads no precision and
    # leaves the product pending, or nothing), the product must still run
    # under "highest", its call's: the query syncs instead of flying it.
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    prev = torch.get_float32_matmul_precision()
    with async_ops(10_000):  # no flight starts by count: only the query
        am, bm = a.to("mgpu"), b.to("mgpu")
        torch_mgpu.synchronize()
        try:
            torch.set_float32_matmul_precision("highest")
            p = am @ bm
            torch.set_float32_matmul_precision("medium")
            q = p * 0.5 if between == "elementwise" else p
            e = torch.mgpu.Event()
            e.record()
            while not e.query():
                pass
            got = q.cpu()
        finally:
            torch.set_float32_matmul_precision(prev)
    # (Close on CUDA lanes, whose products are not the CPU's bit for bit;
    # a product under "medium", TF32 there, is off by far more.)
    assert same_values(got, a @ b * 0.5 if between == "elementwise" else a @ b)
