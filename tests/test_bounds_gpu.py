"""Always-on bounds checks on CUDA: no host synchronisation per call, no device-side assert,
nothing live written, and the error raised at the next poll()/step()."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from hicache.pools import (
    DEBUG_CHECKS_ENV,
    AttentionKind,
    BoundsError,
    HybridSWAPool,
    IndexSpace,
    Indices,
    PageTable,
    RowGeometry,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 4
GEOMETRY = RowGeometry(AttentionKind.MHA, 2, 8, 0, torch.bfloat16)
FULL_SLOTS = (8 + 1) * PAGE


@pytest.fixture(autouse=True)
def _debug_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Safety must not depend on the debug flag."""
    monkeypatch.delenv(DEBUG_CHECKS_ENV, raising=False)


@pytest.fixture
def pool() -> HybridSWAPool:
    """Layers 0, 2 full and 1, 3 SWA; every page allocated and written with known rows."""
    hybrid = HybridSWAPool(num_layers=4, swa_layers=[1, 3], full_pages=8, swa_pages=8,
                           page_size=PAGE, geometry=GEOMETRY, device="cuda")
    slots = hybrid.try_alloc(8 * PAGE)
    assert slots is not None
    locs = Indices(slots.tensor.cuda(), IndexSpace.DEVICE_FULL)
    for layer in range(4):
        k = torch.randn(8 * PAGE, 2, 8, device="cuda").to(torch.bfloat16)
        hybrid.set_kv(layer, locs, k, k + 1)
    _warm(hybrid)
    torch.cuda.synchronize()
    return hybrid


def _warm(pool: HybridSWAPool) -> None:
    """First checks allocate the guards' pinned rings (allocation is not per call)."""
    ok = Indices(torch.tensor([PAGE], device="cuda"), IndexSpace.DEVICE_FULL)
    pool.translate_full_to_swa(ok)
    pool.swa.guard.check(torch.tensor([1], device="cuda"), bound=2, op="warm")
    pool.raise_if_tripped()


@contextmanager
def _no_sync() -> Iterator[None]:
    """Any host synchronisation inside raises (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _full(*slots: int) -> Indices:
    """CUDA DEVICE_FULL indices (int64 when a value needs it); made before a _no_sync block,
    as the copy from a Python list synchronises."""
    dtype = torch.int32 if all(abs(s) < 2**31 for s in slots) else torch.int64
    return Indices(torch.tensor(slots, dtype=dtype, device="cuda"), IndexSpace.DEVICE_FULL)


@pytest.mark.parametrize("slot", [-1, FULL_SLOTS, -FULL_SLOTS, 10**12])
def test_set_kv_bad_slot_writes_nothing_live_and_raises_at_poll(pool: HybridSWAPool,
                                                                 slot: int) -> None:
    """Seed 004 on CUDA: -1 (the last slot's SWA row), num_slots (a device assert before),
    -num_slots: the call neither syncs nor asserts, live rows are unchanged, the padding row
    stays zero and the error names the op, pool, value and bound."""
    before = pool.full.data.clone(), pool.swa.data.clone()
    k = torch.ones(2, 2, 8, device="cuda", dtype=torch.bfloat16)
    locs = _full(PAGE, slot)
    with _no_sync():
        pool.set_kv(1, locs, k, k)
    torch.cuda.synchronize()
    swa_slot = int(pool.swa_slots_of(Indices(torch.tensor([PAGE]), IndexSpace.DEVICE_FULL))
                   .tensor[0])
    expected = before[1].clone()
    expected[:, 0, swa_slot] = 1
    assert torch.equal(pool.swa.data, expected)
    assert torch.equal(pool.full.data, before[0])
    with pytest.raises(BoundsError, match=rf"set_kv\(layer=1\): slot {slot} is "
                                          rf"(negative|out of range) for pool 'full' "
                                          rf"\(valid slots are 0\.\.{FULL_SLOTS - 1}\)"):
        pool.raise_if_tripped()
    pool.raise_if_tripped()  # reported once


def test_translate_of_minus_one_is_padding_not_the_last_slot(pool: HybridSWAPool) -> None:
    """translate_full_to_swa(-1) gives the padding slot, not the last slot's SWA slot."""
    locs = _full(-1, PAGE)
    with _no_sync():
        out = pool.translate_full_to_swa(locs)
    assert out.tensor.tolist()[0] == 0
    with pytest.raises(BoundsError, match=r"translate_full_to_swa: slot -1 is negative"):
        pool.raise_if_tripped()


def test_page_table_out_of_range_reads_padding_and_raises(pool: HybridSWAPool) -> None:
    """A page past the full pool translates to the padding page; the error follows."""
    table = PageTable(torch.tensor([[1, 9]], dtype=torch.int32, device="cuda"),
                      IndexSpace.DEVICE_FULL, PAGE)
    with _no_sync():
        swa = pool.translate_page_table(table)
    assert swa.tensor.tolist()[0][1] == 0
    with pytest.raises(BoundsError, match=r"translate_page_table: page 9 is out of range"):
        pool.raise_if_tripped()
    with pytest.raises(ValueError, match=r"already in DEVICE_SWA space"):
        pool.translate_page_table(swa)


def test_refilled_buffer_on_cuda_is_bit_exact(pool: HybridSWAPool) -> None:
    """Seeds 000/001 on CUDA: one out_cache_loc buffer refilled in place between forwards;
    every row of both forwards is where it belongs."""
    buffer = torch.tensor([PAGE, PAGE + 1], dtype=torch.int32, device="cuda")
    locs = Indices(buffer, IndexSpace.DEVICE_FULL)
    k1 = torch.randn(2, 2, 8, device="cuda").to(torch.bfloat16)
    k2 = torch.randn(2, 2, 8, device="cuda").to(torch.bfloat16)
    handle = pool.forward_locs(locs)
    for layer in range(4):
        pool.set_kv(layer, handle, k1, k1)
    buffer.copy_(torch.tensor([2 * PAGE, 2 * PAGE + 1], dtype=torch.int32))
    for layer in range(4):
        pool.set_kv(layer, locs, k2, k2)
    first = pool.translate_full_to_swa(_full(PAGE, PAGE + 1)).tensor.long()
    second = pool.translate_full_to_swa(_full(2 * PAGE, 2 * PAGE + 1)).tensor.long()
    for layer in (1, 3):
        assert torch.equal(pool.key_buffer(layer)[first], k1)
        assert torch.equal(pool.key_buffer(layer)[second], k2)
    pool.raise_if_tripped()


def _captured_set_kv(pool: HybridSWAPool, layer: int, static: torch.Tensor
                     ) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one ``set_kv`` of ``layer`` at the slot ``static`` holds when it is
    replayed (run once outside the capture first, on a side stream, as capture needs)."""
    k = torch.ones(1, 2, 8, device="cuda", dtype=torch.bfloat16)
    locs = Indices(static, IndexSpace.DEVICE_FULL)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pool.set_kv(layer, locs, k, k)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv(layer, locs, k, k)
    return graph


@pytest.mark.skipif(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
                    reason="CUDA graph capture needs the caching allocator")
def test_captured_check_reports_a_bad_replay(pool: HybridSWAPool) -> None:
    """set_kv inside a CUDA graph: a replay with a bad slot writes nothing live and is
    reported at the next read; a clean replay afterwards reports nothing."""
    static = torch.tensor([PAGE], dtype=torch.int32, device="cuda")
    graph = _captured_set_kv(pool, 1, static)
    pool.raise_if_tripped()
    before = pool.swa.data.clone()
    static.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool.swa.data, before)
    with pytest.raises(BoundsError,
                       match=r"captured in a CUDA graph found a value -1 in pool 'full'"):
        pool.raise_if_tripped()
    torch.cuda.synchronize()
    static.fill_(PAGE)
    graph.replay()
    torch.cuda.synchronize()
    pool.raise_if_tripped()


@pytest.mark.skipif(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
                    reason="CUDA graph capture needs the caching allocator")
@pytest.mark.parametrize(("replayed", "found"), [
    ((-3, -1), "a value -3 in pool"),  # the lowest of the replays before the read
    ((-1, -3), "a value -3 in pool"),
    ((FULL_SLOTS + 5, FULL_SLOTS), "a value 6 past its bound in pool"),  # the farthest
    ((FULL_SLOTS, FULL_SLOTS + 5), "a value 6 past its bound in pool"),
    ((-1, PAGE), "a value -1 in pool"),  # a clean replay after it clears nothing
    ((FULL_SLOTS + 5, PAGE), "a value 6 past its bound in pool"),
])
def test_captured_checks_report_the_worst_replay(pool: HybridSWAPool, replayed: tuple[int, int],
                                                 found: str) -> None:
    """Two replays of a captured set_kv before a read, one or both bad: one error, naming
    the lowest value below the range or the farthest past its end. (The record was once
    made inside the capture, so every replay cleared it: a clean replay after a bad one
    hid the error.)"""
    static = torch.tensor([PAGE], dtype=torch.int64, device="cuda")
    graph = _captured_set_kv(pool, 0, static)
    before = pool.full.data.clone()
    for value in replayed:
        static.fill_(value)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool.full.data, before)
    with pytest.raises(BoundsError, match=f"captured in a CUDA graph found {found} 'full'"):
        pool.raise_if_tripped()
    pool.raise_if_tripped()  # reported once


def test_service_step_raises_the_cuda_error() -> None:
    """Through the service on CUDA: the background thread keeps polling, step() raises the
    bounds error once the GPU ran the check, and the service goes on."""
    from test_service import make_config, put, wait_for

    from hicache.factory import build_service

    with build_service(make_config(hybrid=True, device="cuda", interval_s=0.01)) as service:
        pool = service.device_pool
        assert isinstance(pool, HybridSWAPool)
        k = torch.ones(1, 1, 2, device="cuda")
        locs = _full(-1)
        pool.set_kv(1, locs, k, k)
        torch.cuda.synchronize()
        assert put(service, [1, 1])  # a backup in flight: the thread polls it
        wait_for(lambda: service.stats.polls >= 1 and not service.controller.num_in_flight)
        assert service.stats.background_errors == 0
        with pytest.raises(BoundsError, match=r"set_kv\(layer=1\): slot -1 is negative"):
            service.step()
        assert service.step() == 1  # the backup's ack, which the thread queued
        service.check_integrity()
