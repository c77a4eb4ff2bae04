"""``alloc_device`` short of room evicts what the request lacks, no more (CPU): device
pages of cached, backed-up sequences, or, for a hybrid model short only of SWA slots,
the SWA rows of nodes whose host copy holds them, with every full row kept."""

from __future__ import annotations

import dataclasses

import pytest
from test_service import PAGE, make_config

from hicache import HiCacheService
from hicache.config import HiCacheConfig
from hicache.factory import build_service
from hicache.pools import IndexSpace


def config(page: int, hybrid: bool = False) -> HiCacheConfig:
    """test_service's config at pages of ``page`` tokens (1: a shortfall of one token)."""
    return dataclasses.replace(make_config(hybrid=hybrid), page_size_tokens=page)


def cache_one_page_sequences(service: HiCacheService, count: int) -> None:
    """``count`` sequences of one page each under the root (each its own leaf), inserted
    and backed up (write-through: applied at the step)."""
    page = service.tree.page_size
    for i in range(count):
        slots = service.alloc_device(page)
        assert slots is not None
        service.insert([100 + i, *range(200 + page * i, 200 + page * i + page - 1)], slots)
    service.step()
    assert all(node.is_backed_up for node in service.tree.nodes())


@pytest.mark.parametrize("page", [1, PAGE])
@pytest.mark.parametrize("missing_pages", [1, 2, 3])
def test_a_short_device_evicts_what_the_allocation_lacks(missing_pages: int, page: int
                                                         ) -> None:
    service = build_service(config(page))
    try:
        device = service.tree.io.allocators()[IndexSpace.DEVICE_FULL]
        cache_one_page_sequences(service, device.num_free_tokens // page - 2)
        free = device.num_free_tokens
        assert free == 2 * page
        before = service.tree.stats.evicted_device_tokens
        got = service.alloc_device(free + missing_pages * page)
        assert got is not None
        assert service.tree.stats.evicted_device_tokens - before == missing_pages * page
        assert device.num_free_tokens == 0
        service.free_device(got)
        service.check_integrity()
    finally:
        service.stop()


@pytest.mark.parametrize("page", [1, PAGE])
def test_a_hybrid_short_of_swa_slots_evicts_only_the_swa_rows_it_lacks(page: int) -> None:
    service = build_service(config(page, hybrid=True))
    try:
        io = service.tree.io
        full = io.allocators()[IndexSpace.DEVICE_FULL]
        cache_one_page_sequences(service, io.device_swa_free_tokens() // page - 1)
        assert io.device_swa_free_tokens() == page
        assert full.num_free_tokens > 2 * page
        stats = service.tree.stats
        evicted_swa, evicted_device = stats.evicted_swa_tokens, stats.evicted_device_tokens
        got = service.alloc_device(2 * page)
        assert got is not None
        assert stats.evicted_swa_tokens - evicted_swa == page
        assert stats.evicted_device_tokens == evicted_device
        assert all(node.on_device for node in service.tree.nodes())
        service.free_device(got)
        service.check_integrity()
    finally:
        service.stop()
