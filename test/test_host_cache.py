"""Host memory for the lanes: large blocks kernels allocate while a plan runs
are kept when freed and reused, so that repeated runs do not page-fault on
fresh memory. Eager code never gets these blocks."""
import os
import subprocess
import sys

import torch

import torch_mgpu


def big_graph(x):
    # Intermediates of 1 MiB (above the 128 KiB the cache starts at).
    y = torch.tanh(x @ x)
    return torch.sigmoid(y @ x).sum(0)


def test_blocks_are_reused_across_runs_and_released_on_request():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 512, generator=g)
    xm = x.to("mgpu")
    want = big_graph(x)
    torch.testing.assert_close(big_graph(xm).cpu(), want)
    s0 = torch_mgpu.stats()
    assert s0["host_cache_bytes"] > 0  # the intermediates, freed at their last use, are kept
    for _ in range(3):
        torch.testing.assert_close(big_graph(xm).cpu(), want)
    s1 = torch_mgpu.stats()
    assert s1["host_cache_hits"] - s0["host_cache_hits"] >= 3
    torch_mgpu.empty_cache()
    assert torch_mgpu.stats()["host_cache_bytes"] == 0
    torch.testing.assert_close(big_graph(xm).cpu(), want)  # and it goes on working


def test_eager_allocations_do_not_touch_the_cache():
    torch_mgpu.empty_cache()
    s0 = torch_mgpu.stats()
    for _ in range(5):
        a = torch.randn(1024, 1024)
        b = torch.tanh(a @ a)
        del a, b
    s1 = torch_mgpu.stats()
    assert s1["host_cache_bytes"] == s0["host_cache_bytes"] == 0
    assert s1["host_cache_hits"] == s0["host_cache_hits"]


def run_child(code, **env):
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


CHILD = (
    "import torch, torch_mgpu\n"
    "x = torch.randn(512, 512)\n"
    "xm = x.to('mgpu')\n"
    "for _ in range(4):\n"
    "    assert torch.allclose(torch.tanh(xm @ xm).sum(0).cpu(), torch.tanh(x @ x).sum(0), atol=1e-4)\n"
    "s = torch_mgpu.stats()\n"
    "print(s['host_cache_hits'], s['host_cache_bytes'])\n"
)


def test_cache_size_is_bounded_by_the_environment():
    hits, cached = map(int, run_child(CHILD, TORCH_MGPU_HOST_CACHE_MB="0").split())
    assert hits == 0 and cached == 0
    hits, cached = map(int, run_child(CHILD, TORCH_MGPU_HOST_CACHE_MB="1").split())
    assert cached <= 1 << 20
    hits, cached = map(int, run_child(CHILD).split())
    assert hits > 0 and cached > 0


def test_ops_run_at_their_call_reuse_blocks_too():
    """At the call, a kernel's large output comes from the cache as on the
    lanes (a training step at the call page-faulted on fresh memory each
    step where glibc had returned it)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 512, generator=g)
    xm = x.to("mgpu")
    torch_mgpu.synchronize()
    want = big_graph(x)
    saved = torch_mgpu._C._at_call()
    torch_mgpu.configure(at_call="on")
    try:
        torch.testing.assert_close(big_graph(xm).cpu(), want)
        s0 = torch_mgpu.stats()
        for _ in range(3):
            torch.testing.assert_close(big_graph(xm).cpu(), want)
        s1 = torch_mgpu.stats()
        assert s1["at_call_ops"] > s0["at_call_ops"]
        assert s1["host_cache_hits"] - s0["host_cache_hits"] >= 3
    finally:
        torch_mgpu.synchronize()
        torch_mgpu._C._set_at_call(saved)
