"""Memory statistics on mgpu (torch.accelerator.memory_* and torch.mgpu.*):
they count the bytes mgpu values really hold: materialized values, their
copies, and the intermediates of a plan while it runs. Pending values hold
nothing."""
import gc

import pytest
import torch

import torch_mgpu

# Host bytes: on CUDA lanes values also hold copies on the GPU.
pytestmark = pytest.mark.usefixtures("cpu_lanes")

A = torch.accelerator


def settled():
    gc.collect()
    torch_mgpu.synchronize()
    return A.memory_allocated()


def test_a_moved_tensor_holds_its_bytes_until_it_dies():
    before = settled()
    x = torch.randn(256, 128).to("mgpu")
    assert A.memory_allocated() - before == 256 * 128 * 4
    assert torch.mgpu.memory_allocated() == A.memory_allocated()
    view = x[10:20].t()  # views share the bytes
    assert A.memory_allocated() - before == 256 * 128 * 4
    del x, view
    gc.collect()
    assert A.memory_allocated() == before


def test_pending_values_hold_nothing_and_results_hold_their_bytes():
    x = torch.randn(200, 300).to("mgpu")
    before = settled()
    y = (x @ x.t()).relu()
    assert torch_mgpu.pending_ops() > 0
    assert A.memory_allocated() == before
    y.cpu()
    assert A.memory_allocated() - before == 200 * 200 * 4


def test_the_peak_counts_a_plans_intermediates():
    x = torch.randn(512, 512).to("mgpu")
    before = settled()
    A.reset_peak_memory_stats()
    assert A.max_memory_allocated() == before
    s = (x @ x).sum()  # the 1 MiB product lives only while the plan runs
    s.item()
    assert A.memory_allocated() - before == 4
    assert A.max_memory_allocated() - before >= 512 * 512 * 4
    stats = A.memory_stats()
    assert stats["allocated_bytes.all.current"] == A.memory_allocated()
    assert stats["allocated_bytes.all.peak"] == A.max_memory_allocated()
    assert stats["allocation.all.current"] >= 1


def test_cumulative_counts_and_their_reset():
    A.reset_accumulated_memory_stats()
    x = torch.randn(64, 64).to("mgpu")
    stats = A.memory_stats()
    assert stats["allocated_bytes.all.allocated"] >= 64 * 64 * 4
    assert stats["allocation.all.allocated"] >= 1
    del x
    gc.collect()
    assert A.memory_stats()["allocated_bytes.all.freed"] >= 64 * 64 * 4
    A.reset_accumulated_memory_stats()
    assert A.memory_stats()["allocated_bytes.all.allocated"] == 0


def test_reserved_includes_the_lanes_reusable_blocks_and_empty_cache_frees_them():
    x = torch.randn(1024, 1024).to("mgpu")
    for _ in range(2):
        ((x @ x) + 1).sum().item()  # megabyte intermediates: kept for reuse when freed
    settled()
    cached = torch_mgpu.stats()["host_cache_bytes"]
    assert cached >= 1024 * 1024 * 4  # a freed product's block
    assert A.memory_reserved() == A.memory_allocated() + cached
    peak = A.max_memory_reserved()
    assert peak >= A.memory_reserved()
    A.empty_cache()
    assert A.memory_reserved() == A.memory_allocated()
    assert torch_mgpu.stats()["host_cache_bytes"] == 0
    assert A.max_memory_reserved() == peak  # a peak does not come down with the cache
    A.reset_peak_memory_stats()
    assert A.max_memory_reserved() == A.memory_reserved()


def test_values_computed_in_place_are_counted_once():
    x = torch.randn(128, 128).to("mgpu")
    before = settled()
    x.mul_(2).add_(1)
    x.cpu()
    assert A.memory_allocated() == before


def test_mem_get_info_is_the_hosts_memory():
    free, total = torch.mgpu.mem_get_info()
    assert 0 < free <= total
    assert (free, total)[1] == A.get_memory_info()[1]


def test_a_failed_op_leaves_the_counts_consistent():
    before = settled()
    x = torch.randn(4, 4).to("mgpu")
    bad = x.index_select(0, torch.tensor([0, 9]).to("mgpu"))  # out of range: only the data says so
    with pytest.raises((IndexError, RuntimeError)):
        bad.cpu()
    del bad, x
    gc.collect()
    assert settled() == before
