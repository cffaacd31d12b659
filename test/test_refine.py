"""Plans refined by measurement: after a cached plan's first runs, the graph
is planned again, once, with each node's measured / predicted time as a
correction to the cost model, when some node was mispredicted."""
import os
import subprocess
import sys

import pytest
import torch

import torch_mgpu

# What nodes do on the lanes: tier 0, whatever the default (conftest).
pytestmark = pytest.mark.usefixtures("node_by_node")


@pytest.fixture
def two_lanes_sync():
    before = (torch_mgpu.lanes(), torch_mgpu.policy(), torch_mgpu.async_ops())
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=2, policy="auto")
    torch_mgpu.set_async_ops(0)  # one graph per sync: the same graph every run
    yield
    torch_mgpu.set_async_ops(before[2])
    torch_mgpu.configure(devices=["cpu"], lanes_per_device=len(before[0]), policy=before[1])


def workload(a, xs):
    # eigh has no formula in the cost model (one "flop" per output element):
    # it is predicted far cheaper than it runs.
    w = torch.linalg.eigh(a).eigenvalues.sum()
    return w + sum(torch.tanh(x @ x).sum() for x in xs)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(160, 160, generator=g, dtype=torch.float64)
    return a + a.T, [torch.randn(96, 96, generator=g, dtype=torch.float64) for _ in range(4)]


def eigh_times(plan):
    (e,) = [e for e in plan.timeline() if e["op"] == "aten::_linalg_eigh"]
    return e["end"] - e["start"], e["predicted_end"] - e["predicted_start"]


def test_a_mispredicted_graph_is_planned_again_once(two_lanes_sync, calibrated_model):
    a, xs = inputs()
    want = workload(a, xs)
    ma, mxs = a.to("mgpu"), [x.to("mgpu") for x in xs]
    plans = []
    for _ in range(8):
        got = workload(ma, mxs)
        torch.testing.assert_close(got.cpu(), want)
        plans.append((torch_mgpu.last_plan(), torch_mgpu.stats()["plans_built"]))
    first = plans[0][0]
    measured, predicted = eigh_times(first)
    assert predicted < 0.2 * measured, "the test needs a node the model gets wrong"
    assert not first.refined
    # Refined after the cold run and three measured runs, then kept.
    refined_at = [k for k, (p, _) in enumerate(plans) if p.refined]
    assert refined_at and refined_at[0] == 4 and refined_at == list(range(4, 8))
    # The new plan is made at the end of the fourth run, for the fifth.
    assert plans[3][1] == plans[2][1] + 1
    assert len({built for _, built in plans[3:]}) == 1, "planned again more than once"
    # The refined prediction is the median of the three measured runs (the
    # last run's own time moves with the machine's load; those runs' do not).
    seen = sorted(eigh_times(p)[0] for p, _ in plans[1:4])
    _, predicted = eigh_times(plans[-1][0])
    assert 0.9 * seen[0] < predicted < 1.1 * seen[-1]
    assert first.graph_hash == plans[-1][0].graph_hash
    assert "refined by measured node times" in str(plans[-1][0])


def test_refinement_can_be_turned_off():
    code = (
        "import torch, torch_mgpu, sys\n"
        "sys.path.insert(0, %r)\n"
        "from test_refine import workload, inputs\n"
        "torch_mgpu.configure(devices=['cpu'], lanes_per_device=2)\n"
        "torch_mgpu.set_async_ops(0)\n"
        "a, xs = inputs()\n"
        "ma, mxs = a.to('mgpu'), [x.to('mgpu') for x in xs]\n"
        "for _ in range(7): workload(ma, mxs).cpu()\n"
        "print(torch_mgpu.last_plan().refined)\n" % os.path.dirname(__file__))
    for env, want in (("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TORCH_MGPU_REFINE": env},
                             capture_output=True, text=True, check=True).stdout.split()
        assert out[-1] == want


def test_a_pinned_model_is_what_plans_follow_and_is_not_refined(two_lanes_sync):
    from conftest import REFERENCE_MODEL, pin_reference_model
    a, xs = inputs()
    ma, mxs = a.to("mgpu"), [x.to("mgpu") for x in xs]
    try:
        torch_mgpu._C._pin_cost_model(dict(REFERENCE_MODEL, gemm_flops_per_s=1.0e6, small_gemm_flops_per_s=1.0e6))
        assert torch_mgpu._C._cost_model_pinned()
        assert torch_mgpu._C._cost_model()["gemm_flops_per_s"] == 1.0e6
        for _ in range(7):
            workload(ma, mxs).cpu()
        plan = torch_mgpu.last_plan()
        assert not plan.refined  # measured times do not move a pinned model's plans
        # A product of 96x96 at a million flops a second: the pinned rate.
        (mm,) = [e for e in plan.timeline() if e["op"] == "aten::mm"][:1]
        assert mm["predicted_end"] - mm["predicted_start"] > 1.0
        with pytest.raises(RuntimeError, match="unknown figure 'gemm'"):
            torch_mgpu._C._pin_cost_model({"gemm": 1.0})
        torch_mgpu._C._pin_cost_model(None)
        assert not torch_mgpu._C._cost_model_pinned()
        assert torch_mgpu._C._cost_model()["gemm_flops_per_s"] > 1.0e7  # calibrated
    finally:
        pin_reference_model()
