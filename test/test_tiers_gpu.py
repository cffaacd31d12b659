"""Tier 1 on CUDA lanes (run by `scripts/dev.sh gpu`; skipped without a
GPU: test_stream_sanitizer checks the same code on CPU stream lanes)."""
import pytest
import torch

import torch_mgpu
from test_tiers import no_trial, tiered, tower_inputs, towers  # noqa: F401 (fixtures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA lanes")
def test_compiled_parts_run_on_the_streams_of_a_gpu(tiered, no_trial):
    # CUDA lanes: the graph compiles for the GPU, each part queued on its
    # lane's stream after the events of the parts it reads (the same code
    # test_stream_sanitizer checks on CPU stream lanes).
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(devices=["cuda:0"], lanes_per_device=2)
    try:
        cpu = tower_inputs(7, 256)  # products that leave room on the device for the other lane's
        mg = [t.to("mgpu") for t in cpu]
        tiers = []
        for k in range(5):
            want = towers(*cpu)
            for w, t in zip(want, towers(*mg)):
                torch.testing.assert_close(t.cpu(), w, rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(mg[4].cpu(), cpu[4], rtol=1e-3, atol=1e-2)
            tiers.append(torch_mgpu.last_plan().tier)
            if k == 1:
                assert torch_mgpu.wait_for_compiles(600)
        assert tiers == [0, 0, 1, 1, 1], torch_mgpu._C._tier_last_error()
        # Whole or in parts, as the GPU's cost model splits it (printed for the GPU run's log).
        print("tier 1 on CUDA lanes:", torch_mgpu.last_plan().compiled)
    finally:
        torch_mgpu.configure(**torch_mgpu._configuration_of(*before))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA lanes")
def test_a_device_argument_compiles_for_the_gpu(tiered, no_trial):
    # A tensor made in the graph (device="mgpu", recorded as the host) is
    # made on the lanes' GPU by the compiled code, as tier 0 makes it.
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    torch_mgpu.configure(devices=["cuda:0"], lanes_per_device=2)
    try:
        x = torch.randn(64, 64)
        xm = x.to("mgpu")

        def f(t):
            return torch.tanh(t) * torch.full((64,), 2.0, device=t.device) + torch.arange(64, device=t.device)

        tiers = []
        for k in range(4):
            torch.testing.assert_close(f(xm).cpu(), f(x), rtol=1e-4, atol=1e-4)
            tiers.append(torch_mgpu.last_plan().tier)
            if k == 1:
                assert torch_mgpu.wait_for_compiles(600)
        assert tiers == [0, 0, 1, 1], torch_mgpu._C._tier_last_error()
    finally:
        torch_mgpu.configure(**torch_mgpu._configuration_of(*before))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA lanes")
def test_a_hot_graph_on_the_streams_of_a_gpu_replays_with_eager_results():
    # Replay on CUDA stream lanes: the recording captured once as a CUDA
    # graph over the lanes' streams (issued in the order
    # Replay.IssuedFromOneThread... checks on CPU stream lanes), then
    # launched: eager's values, an in-place write into an input, earlier
    # results kept.
    from test_stream_sanitizer import replay_step
    before = (torch_mgpu.lanes(), torch_mgpu.policy())
    hits, compile_hits, saved_async = (torch_mgpu._C._replay_hits(), torch_mgpu._C._tier_compile_hits(),
                                       torch_mgpu.async_ops())
    torch_mgpu.configure(devices=["cuda:0"], lanes_per_device=3, compile=0)
    trial = torch_mgpu._C._replay_trial()
    torch_mgpu._C._set_replay_hits(2)
    torch_mgpu._C._set_replay_trial(False)
    torch_mgpu.set_async_ops(0)
    try:
        gen = torch.Generator().manual_seed(4)
        w = torch.randn(256, 256, generator=gen)
        b_cpu = torch.randn(256, generator=gen)
        b = b_cpu.to("mgpu")
        tiers, kept = [], []
        for _ in range(6):
            x = torch.randn(256, 256, generator=gen)
            want = replay_step(x, w, b_cpu)
            got = replay_step(x.to("mgpu"), w.to("mgpu"), b)
            for g, e in zip(got, want):
                torch.testing.assert_close(g.cpu(), e, rtol=1e-3, atol=1e-3)
            tiers.append(torch_mgpu.last_plan().tier)
            kept.append((got[0], want[0].clone()))
        assert tiers == [0, 0, 0, 2, 2, 2], (tiers, torch_mgpu.last_plan().replay)
        # One launch of the CUDA graph captured from the recording.
        assert "as one CUDA graph" in torch_mgpu.last_plan().replay, torch_mgpu.last_plan().replay
        assert torch_mgpu.stats()["replay_captures"] >= 1
        for g, e in kept:
            torch.testing.assert_close(g.cpu(), e, rtol=1e-3, atol=1e-3)
        print("replay on CUDA lanes:", torch_mgpu.last_plan().replay)
    finally:
        torch_mgpu._C._set_replay_hits(hits)
        torch_mgpu._C._set_replay_trial(trial)
        torch_mgpu.set_async_ops(saved_async)
        torch_mgpu.configure(**torch_mgpu._configuration_of(*before), compile=compile_hits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA lanes")
def test_a_graph_that_syncs_replays_step_by_step_and_capture_goes_on():
    # histc over its input's own range reads that range on the host (a
    # sync, which a capture refuses). Known before capture
    # (runtime::capture_blocker): the graph replays step by step, the
    # reason in last_plan(). With that check off the capture is tried and
    # fails: the same, with CUDA's error; and every stream that joined the
    # failed capture left it (another graph then captures on the same
    # streams and replays as one CUDA graph).
    from test_stream_sanitizer import replay_step
    before = torch_mgpu.configuration()
    hits, saved_async = torch_mgpu._C._replay_hits(), torch_mgpu.async_ops()
    trial = torch_mgpu._C._replay_trial()
    torch_mgpu.configure(devices=["cuda:0"], lanes_per_device=3, compile=0)
    torch_mgpu._C._set_replay_hits(2)
    torch_mgpu._C._set_replay_trial(False)
    torch_mgpu.set_async_ops(0)

    def syncing(x, y):
        return torch.histc(x.sin(), bins=8) + 1, (y @ y).relu(), (x * 2).cos()

    def hot(n):
        gen = torch.Generator().manual_seed(n)
        tiers, notes = [], []
        for _ in range(6):
            x, y = torch.randn(n, generator=gen), torch.randn(128, 128, generator=gen)
            got = syncing(x.to("mgpu"), y.to("mgpu"))
            for g, e in zip(got, syncing(x, y)):
                torch.testing.assert_close(g.cpu(), e, rtol=1e-3, atol=1e-3)
            tiers.append(torch_mgpu.last_plan().tier)
            notes.append(torch_mgpu.last_plan().replay)
        assert tiers == [0, 0, 0, 2, 2, 2], (tiers, notes)
        assert "not captured as a CUDA graph: " in notes[-1], notes
        assert "as one CUDA graph" not in notes[-1], notes
        return notes[-1]

    try:
        captures = torch_mgpu.stats()["replay_captures"]
        known = hot(4096)
        assert "aten::histc" in known and "reads its input's range on the host (min == max)" in known, known
        torch_mgpu._C._set_capture_checks(False)
        failed = hot(2048)
        assert "aten::histc" in failed and "capturing" in failed, failed
        print("a capture that fails:", failed)
        assert torch_mgpu.stats()["replay_captures"] == captures
        gen = torch.Generator().manual_seed(6)
        w = torch.randn(128, 128, generator=gen)
        b_cpu = torch.randn(128, generator=gen)
        b = b_cpu.to("mgpu")
        for _ in range(6):
            x = torch.randn(128, 128, generator=gen)
            want = replay_step(x, w, b_cpu)
            for g, e in zip(replay_step(x.to("mgpu"), w.to("mgpu"), b), want):
                torch.testing.assert_close(g.cpu(), e, rtol=1e-3, atol=1e-3)
        assert "as one CUDA graph" in torch_mgpu.last_plan().replay, torch_mgpu.last_plan().replay
        assert torch_mgpu.stats()["replay_captures"] == captures + 1
        torch.cuda.synchronize()
    finally:
        torch_mgpu._C._set_capture_checks(True)
        torch_mgpu._C._set_replay_hits(hits)
        torch_mgpu._C._set_replay_trial(trial)
        torch_mgpu.set_async_ops(saved_async)
        torch_mgpu.configure(**before)
