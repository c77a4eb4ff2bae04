"""SWA rows follow the full rows into the host tier (``host.swa_history: all``): rows that
leave a running request's window are copied to the host (``release_window``), the tree takes
the copies at ``insert``, a load-back restores a reused prefix's window, and ``evict_swa``
frees device SWA rows that have a host copy. Every SWA row that comes back is compared with
what was written."""

from __future__ import annotations

import pytest
import torch
from test_service import PAGE, make_config

from hicache.controller import HybridCacheController
from hicache.factory import build_service
from hicache.pools import HybridSWAPool, IndexSpace, Indices
from hicache.service import HiCacheService


def swa_rows(pool: HybridSWAPool, full: Indices) -> torch.Tensor:
    """The SWA rows (every SWA layer, K and V) of the tokens at ``full``."""
    swa = pool.swa_slots_of(full).tensor
    assert bool((swa != 0).all()), "some token has no SWA slot"
    return pool.swa.data[:, :, swa].clone()


def serve(service: HiCacheService, tokens: list[int]) -> Indices:
    """Allocate, write distinct SWA rows, give back every page before the window (the
    engine's early release), insert; returns the full slots."""
    pool = service.device_pool
    assert isinstance(pool, HybridSWAPool)
    slots = service.alloc_device(len(tokens))
    assert slots is not None
    swa = pool.swa_slots_of(slots).tensor
    pool.swa.data[:, :, swa] = torch.arange(len(tokens), dtype=torch.float32)[None, None, :, None] \
        + 1000.0 * float(tokens[0])
    service.release_window(Indices(slots.tensor[:len(tokens) - 2 * PAGE],
                                   IndexSpace.DEVICE_FULL))
    service.insert(tokens, slots)
    return slots


@pytest.fixture
def service() -> HiCacheService:
    svc = build_service(make_config(hybrid=True))
    yield svc
    svc.stop()


def test_a_prefix_cut_from_a_longer_sequence_gets_its_window_back(service: HiCacheService
                                                                  ) -> None:
    pool = service.device_pool
    assert isinstance(pool, HybridSWAPool)
    tokens = list(range(1, 13))
    full = serve(service, tokens)
    service.step()
    service.check_integrity()
    # tokens 4..7 (the window of the 8-token prefix) lost their device SWA rows
    prefix = Indices(full.tensor[:8], IndexSpace.DEVICE_FULL)
    assert bool((pool.swa_slots_of(prefix).tensor[4:8] == 0).all())
    assert service.tree.stats.window_backup_tokens == 8  # the 8 released tokens
    match = service.match([*tokens[:8], 99, 98])
    assert match.device_hit_tokens == 8 and match.host_hit_tokens == 0
    service.lock(match.last_device_node)
    loaded = service.load_back(match, 32)
    assert loaded.queued and len(loaded.device_indices) == 0 and loaded.num_tokens == 0
    assert loaded.restored_swa_tokens == 4
    service.start_loading()
    service.step()
    window = Indices(full.tensor[4:8], IndexSpace.DEVICE_FULL)
    want = torch.arange(4, 8, dtype=torch.float32)[None, None, :, None] + 1000.0
    assert torch.equal(swa_rows(pool, window), want.expand(-1, -1, -1, pool.swa.data.shape[-1])
                       .expand(pool.swa.data.shape[0], pool.swa.data.shape[1], -1, -1))
    assert service.tree.stats.restored_swa_tokens == 4
    service.release(match.last_device_node)
    service.check_integrity()


def test_evict_swa_frees_backed_up_rows_and_keeps_full_rows(service: HiCacheService) -> None:
    pool = service.device_pool
    assert isinstance(pool, HybridSWAPool)
    full = serve(service, list(range(1, 9)))
    service.step()
    free_before = pool.swa_allocator.num_free_tokens
    assert service.evict_swa(4) >= 4
    assert pool.swa_allocator.num_free_tokens >= free_before + 4
    assert pool.full_allocator.is_allocated(full)
    service.check_integrity()


def test_release_window_of_a_page_the_engine_does_not_hold_changes_nothing(
        service: HiCacheService) -> None:
    full = serve(service, list(range(1, 9)))  # inserted: the tree owns these pages now
    service.step()
    backed = service.tree.stats.window_backup_tokens
    with pytest.raises(ValueError, match="release_window"):
        service.release_window(Indices(full.tensor[:PAGE], IndexSpace.DEVICE_FULL))
    assert service.tree.stats.window_backup_tokens == backed
    service.check_integrity()


def test_free_device_drops_the_copies_of_pages_never_inserted(service: HiCacheService) -> None:
    pool = service.device_pool
    assert isinstance(pool, HybridSWAPool)
    slots = service.alloc_device(8)
    assert slots is not None
    service.release_window(Indices(slots.tensor[:4], IndexSpace.DEVICE_FULL))
    used = service.controller.host_swa.allocator.num_used_tokens
    assert used == 4
    service.free_device(slots)  # waits for the copy, then frees it with the pages
    assert service.controller.host_swa.allocator.num_used_tokens == 0
    assert len(service.tree.window_backups) == 0
    service.check_integrity()


def test_recomputed_pages_of_a_host_only_prefix_keep_one_host_swa_copy(
        service: HiCacheService) -> None:
    """Inserting recomputed pages of a host-only node frees the engine's duplicate copies."""
    pool = service.device_pool
    assert isinstance(pool, HybridSWAPool)
    tokens = list(range(1, 13))
    serve(service, tokens)
    service.step()
    service.evict(10**6)  # host-only now, with the SWA rows of every token on the host
    (node,) = service.tree.nodes()
    assert node.is_host_only and node.host_swa is not None
    kept = node.host_swa.tensor.clone()
    assert bool((kept != 0).all())
    used = service.controller.host_swa.allocator.num_used_tokens
    serve(service, tokens)  # recomputed: its early pages get host SWA copies again
    service.step()
    assert node.on_device and torch.equal(node.host_swa.tensor, kept)
    assert service.controller.host_swa.allocator.num_used_tokens == used
    service.check_integrity()


def test_a_prefix_whose_load_is_in_flight_gets_its_window_restored(
        service: HiCacheService) -> None:
    """A window inside a load still in flight is restored; the node waits for both acks."""
    pool = service.device_pool
    assert isinstance(pool, HybridSWAPool)
    tokens = list(range(1, 13))
    serve(service, tokens)
    service.step()
    service.evict(10**6)
    first = service.match(tokens)  # a load of all 12 tokens: SWA rows for the last 4
    service.lock(first.last_host_node)
    assert service.load_back(first, 32).queued
    service.start_loading()
    second = service.match([*tokens[:8], 99, 98])  # its window (4..7) lies in that load
    assert second.device_hit_tokens == 8
    service.lock(second.last_device_node)
    loaded = service.load_back(second, 32)
    assert loaded.queued and len(loaded.device_indices) == 0
    assert service.tree.stats.refused_load_backs["swa_tail_missing"] == 0
    service.start_loading()
    first_ack, restore_ack = service.controller.poll()  # in the order they were issued
    service.tree.apply_acks([first_ack])
    assert second.last_device_node.load_op is not None  # waits for the restore
    service.tree.apply_acks([restore_ack])
    assert second.last_device_node.load_op is None
    window = Indices(second.device_indices.tensor[4:8], IndexSpace.DEVICE_FULL)
    want = torch.arange(4, 8, dtype=torch.float32)[None, None, :, None] + 1000.0
    assert torch.equal(swa_rows(pool, window), want.expand(*pool.swa.data.shape[:2], -1,
                                                           pool.swa.data.shape[-1]))
    assert service.tree.stats.restored_swa_tokens == 4
    service.release(second.last_device_node)
    service.release(first.last_host_node)
    service.check_integrity()


def test_host_swa_copies_leave_on_their_own_when_their_pool_is_short(
        service: HiCacheService) -> None:
    """A window backup that finds the SWA host pool full and no host-only leaf to evict
    frees the host SWA copies of the least recently used node instead of refusing the
    backup; that node keeps its full rows on both tiers and its device window."""
    pool = service.device_pool
    assert isinstance(pool, HybridSWAPool)
    old = list(range(1, 13))
    serve(service, old)
    service.step()  # on the device, backed up: full and SWA host copies
    node = service.match(old).last_device_node
    assert node.host is not None and node.host_swa is not None
    assert bool((node.host_swa.tensor != 0).any())
    controller = service.controller
    assert isinstance(controller, HybridCacheController)
    host_swa = controller.host_swa.allocator
    squatter = host_swa.try_alloc(host_swa.num_free_tokens)  # the SWA host pool is now full
    assert squatter is not None and host_swa.num_free_tokens == 0
    serve(service, list(range(50, 62)))  # its release_window needs SWA host room
    service.step()
    stats = service.tree.stats
    assert stats.evicted_host_swa_tokens > 0 and stats.refused_backups["host_swa_full"] == 0
    assert stats.evicted_host_tokens == 0, "no full rows left the host"
    assert node.host is not None and not bool((node.host_swa.tensor != 0).any())
    assert service.match(old).device_hit_tokens == len(old), "still cached on the device"
    host_swa.free(squatter)
    service.check_integrity()


def test_alloc_device_frees_backed_up_swa_rows_before_full_rows(
        service: HiCacheService) -> None:
    """An engine that never calls release_window: its inserts keep every SWA row, backed
    up with their nodes; when the SWA pool runs short, alloc_device frees SWA rows that
    have a host copy and keeps every cached prefix on the device."""
    pool = service.device_pool
    assert isinstance(pool, HybridSWAPool)
    sequences = [list(range(1, 9)), list(range(20, 28))]
    for tokens in sequences:
        slots = service.alloc_device(len(tokens))
        assert slots is not None
        service.insert(tokens, slots)
    service.step()  # the write-through backups (full and SWA rows) are acknowledged
    assert pool.swa_allocator.num_free_tokens == 0 and pool.full_allocator.num_free_tokens > 4
    slots = service.alloc_device(4)
    assert slots is not None
    stats = service.tree.stats
    assert stats.evicted_swa_tokens >= 4 and stats.evicted_device_tokens == 0
    for tokens in sequences:
        assert service.match(tokens).device_hit_tokens == len(tokens)
    service.free_device(slots)
    service.check_integrity()
