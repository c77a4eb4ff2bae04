"""Backups of a hybrid (full plus sliding-window) model queued at ``insert`` and issued at
``step()``, as for a full-attention model: one write for all of a step's backups, each node
keeping the host SWA copies it adopted and getting copies of the SWA rows it still holds on
the device; a step short of SWA host room evicts host-only leaves for it. Every SWA row that
comes back is compared with what was written."""

from __future__ import annotations

import pytest
import torch
from radix_helpers import expected_rows
from test_service import make_config, needs_cuda
from test_swa_history import serve, swa_rows

from hicache.factory import build_service
from hicache.pools import HybridSWAPool, IndexSpace, Indices
from hicache.service import HiCacheService

WRITES = "device_to_host"


@pytest.fixture
def service() -> HiCacheService:
    svc = build_service(make_config(hybrid=True))  # 32 device tokens (16 SWA), host 64 + 64
    yield svc
    svc.stop()


def hybrid_pool(service: HiCacheService) -> HybridSWAPool:
    pool = service.device_pool
    assert isinstance(pool, HybridSWAPool)
    return pool


def submitted(service: HiCacheService) -> int:
    return service.controller.stats.ops_submitted[WRITES]


def write_swa(service: HiCacheService, slots: Indices, first: int) -> None:
    """Distinct SWA rows for ``slots`` (every token has an SWA slot): position plus
    ``1000 * first``."""
    pool = hybrid_pool(service)
    swa = pool.swa_slots_of(slots).tensor
    values = torch.arange(len(slots), dtype=torch.float32) + 1000.0 * first
    pool.swa.data[:, :, swa] = values[None, None, :, None]


def serve_whole(service: HiCacheService, tokens: list[int]) -> Indices:
    """Allocate, write SWA rows, insert, with no window released: every token's SWA rows
    are still on the device at the insert."""
    slots = service.alloc_device(len(tokens))
    assert slots is not None
    write_swa(service, slots, tokens[0])
    service.insert(tokens, slots)
    return slots


def tail_comes_back(service: HiCacheService, tokens: list[int], tail: int) -> bool:
    """Load ``tokens`` back from the host and compare the SWA rows of their last ``tail``
    tokens with what :func:`serve_whole` / ``serve`` wrote."""
    match = service.match([*tokens, 99])
    assert match.host_hit_tokens == len(tokens) and match.device_hit_tokens == 0
    loaded = service.load_back(match, 32)
    assert loaded.queued and loaded.num_tokens == len(tokens)
    service.start_loading()
    service.step()
    window = Indices(loaded.device_indices.tensor[-tail:], IndexSpace.DEVICE_FULL)
    rows = swa_rows(hybrid_pool(service), window)
    want = torch.arange(len(tokens) - tail, len(tokens), dtype=torch.float32) + 1000.0 * tokens[0]
    return bool(torch.equal(rows, want[None, None, :, None].expand_as(rows)))


def test_the_inserts_of_one_step_are_one_hybrid_write(service: HiCacheService) -> None:
    prompts = [[first, *range(2, 9)] for first in (1, 2, 3)]
    for tokens in prompts:  # the first 4 tokens' SWA rows leave for the host at once
        serve(service, tokens)
    nodes = [service.match(tokens).last_device_node for tokens in prompts]
    for node in nodes:
        assert node.write_op is not None and node.write_op.queued and node.host is None
        assert node.host_swa is not None  # the window backups it adopted
        assert bool((node.host_swa.tensor[:4] != 0).all())
        assert bool((node.host_swa.tensor[4:] == 0).all())
    service.check_integrity()
    before = submitted(service)
    service.step()
    assert submitted(service) == before + 1  # one op for the three
    for node in nodes:
        assert node.is_backed_up and node.lock_count == 0 and node.write_op is None
        assert node.host_swa is not None and bool((node.host_swa.tensor != 0).all())
    service.check_integrity()
    assert service.evict(24) == 24
    for tokens in prompts:  # the window tail: rows the step's write copied
        assert tail_comes_back(service, tokens, 4)
    service.check_integrity()


def test_a_step_short_of_swa_host_room_evicts_host_leaves_for_it(service: HiCacheService
                                                                 ) -> None:
    """Six host-only prompts hold 48 full and 48 SWA host tokens; an engine's window
    backups take the last 16 SWA host tokens. A step then backs up an 8-token prompt whose
    SWA rows are all on the device: the full host has room, the SWA host none, so the step
    evicts the oldest host-only leaf (full and SWA copies) and writes the backup."""
    olds = [[first, *range(2, 9)] for first in range(10, 16)]
    for tokens in olds:
        serve(service, tokens)
        service.step()
        assert service.evict(8) == 8
    controller = service.controller
    assert controller.host_swa.allocator.num_free_tokens == 16
    held = service.alloc_device(16)  # a running request's pages, out of its window
    assert held is not None
    write_swa(service, held, 50)
    service.release_window(held)
    assert controller.host_swa.allocator.num_free_tokens == 0
    assert controller.host_pool.allocator.num_free_tokens == 16
    tokens = [20, *range(2, 9)]
    serve_whole(service, tokens)
    service.step()
    assert service.tree.stats.refused_backups == {}
    assert service.tree.stats.evicted_host_tokens == 8
    assert service.match([*olds[0], 99]).host_hit_tokens == 0  # the oldest, evicted
    assert service.match([*olds[1], 99]).host_hit_tokens == 8
    node = service.match(tokens).last_device_node
    assert node.is_backed_up and node.host_swa is not None
    assert bool((node.host_swa.tensor != 0).all())
    service.check_integrity()
    service.free_device(held)
    assert service.evict(8) == 8
    assert tail_comes_back(service, tokens, 4)
    service.check_integrity()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "staged"])
def test_a_hybrid_backup_issued_later_reads_the_inserting_streams_rows(backend: str) -> None:
    """Full and SWA rows written on a side stream that first sleeps on the GPU, inserted
    there; the step issues the backup with the default stream current: the host gets the
    rows that stream wrote (the insert's mark orders the copy after it)."""
    service = build_service(make_config(hybrid=True, device="cuda", io_backend=backend))
    try:
        pool = hybrid_pool(service)
        tokens = [5, *range(2, 9)]
        slots = service.alloc_device(len(tokens))
        assert slots is not None
        device = pool.full.device
        index = slots.tensor.to(device)
        swa_index = pool.swa_slots_of(slots).tensor.to(device)
        full = expected_rows(tokens, pool.full.num_layers)  # [n, C, L, row]
        swa = (torch.arange(len(tokens), dtype=torch.float32) + 5000.0)[None, None, :, None]
        swa = swa.expand(*pool.swa.data.shape[:2], -1, pool.swa.data.shape[-1]).to(device)
        full_on_device = full.permute(1, 2, 0, 3).to(device)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # about 0.1 s: the rows land long after the step
            pool.full.data[:, :, index] = full_on_device
            pool.swa.data[:, :, swa_index] = swa
            service.insert(tokens, slots)
        service.step()  # issues the backup with the default stream current
        torch.cuda.synchronize()
        service.step()  # its ack
        node = service.match(tokens).last_device_node
        assert node.is_backed_up and node.host is not None and node.host_swa is not None
        controller = service.controller
        geometry = pool.full.geometry
        host_full = torch.stack([
            torch.stack([controller.host_pool.read_layer_rows(c, layer, node.host.tensor)
                         for layer in range(pool.full.num_layers)], dim=1)
            for c in range(geometry.num_components)], dim=1)
        assert torch.equal(host_full, full)
        host_swa = torch.stack([controller.host_swa.read_layer_rows(c, 0, node.host_swa.tensor)
                                for c in range(geometry.num_components)])
        assert torch.equal(host_swa, swa[:, 0].cpu())
        service.check_integrity()
    finally:
        service.stop()
