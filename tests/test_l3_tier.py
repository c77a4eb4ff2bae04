"""The shared store (L3) inside the cache: backups from host slots to the store, prefetches
from it into host slots, load-backs of what arrived, checked row by row on the CPU, with the
real file store in a temporary directory (Redis in tests/test_l3_redis.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from radix_helpers import expected_rows, read_rows, write_rows

from hicache.config import HiCacheConfig, config_from_dict
from hicache.factory import build_service
from hicache.pools import DeviceKVPool, IndexSpace, Indices
from hicache.service import HiCacheService

PAGE = 2
MODEL = {"model_id": "test/model", "model_revision": "r1"}


def make_config(path: Path, *, policy: str = "write_through", prefetch: str = "wait_complete",
                threshold: int = 0, device_tokens: int = 32, **storage: Any) -> HiCacheConfig:
    return config_from_dict({
        "page_size_tokens": PAGE,
        "model": {"num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": device_tokens, "device": "cpu"},
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 60.0},
        "storage": {"backend": "file", "path": str(path), "write_policy": policy,
                    "prefetch_policy": prefetch, "prefetch_threshold_tokens": threshold,
                    **storage},
    })


def pool_of(service: HiCacheService) -> DeviceKVPool:
    pool = service.device_pool
    assert isinstance(pool, DeviceKVPool)
    return pool


def put(service: HiCacheService, tokens: list[int]) -> None:
    """Engine step: allocate, write the rows, insert."""
    slots = service.alloc_device(len(tokens))
    assert slots is not None
    pool = pool_of(service)
    write_rows(pool, slots.tensor[:len(tokens)], expected_rows(tokens, pool.num_layers))
    service.insert(tokens, slots)


def settle(service: HiCacheService, timeout_s: float = 10.0) -> None:
    """Apply acks until the host backups and the store's puts are all done."""
    deadline = time.monotonic() + timeout_s
    while True:
        service.step()
        tier = service.storage
        assert tier is not None
        busy = any(n.store_op is not None or n.write_op is not None
                   for n in service.tree.nodes())
        if not busy and service.controller.num_in_flight == 0 \
                and not any(tier.queue_depths.values()):
            return
        assert time.monotonic() < deadline, "backups did not finish"
        time.sleep(0.002)


def fetch(service: HiCacheService, tokens: list[int]) -> tuple[int, Indices]:
    """Engine path for a new request: match, prefetch, wait, finish, match, load back.
    Returns tokens attached from the store and the device slots of the whole hit."""
    key = service.key(tokens)
    match = service.match(key)
    prefetch = service.prefetch(key, match)
    attached = 0
    if prefetch is not None:
        assert service.wait_prefetch(prefetch, timeout_s=10.0)
        attached = service.finish_prefetch(prefetch)
        match = service.match(key)
    loaded = service.load_back(match, 10**6)
    assert loaded.queued
    service.start_loading()
    service.step()
    device = torch.cat([match.device_indices.tensor, loaded.device_indices.tensor])
    return attached, Indices(device, IndexSpace.DEVICE_FULL)


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[HiCacheService, HiCacheService]]:
    """Two services (two engine processes) sharing one file store."""
    a = build_service(make_config(tmp_path / "l3"), **MODEL)
    b = build_service(make_config(tmp_path / "l3"), **MODEL)
    yield a, b
    a.stop()
    b.stop()


def test_a_prefix_cached_by_one_instance_is_loaded_by_another(two) -> None:
    a, b = two
    tokens = list(range(100, 120))
    put(a, tokens)
    settle(a)
    assert a.storage is not None and a.storage.stats.backup_pages["stored"] == 10
    attached, device = fetch(b, tokens)
    assert attached == 20
    pool = pool_of(b)
    assert torch.equal(read_rows(pool, device.tensor), expected_rows(tokens, pool.num_layers))
    assert b.storage is not None and b.storage.stats.prefetch_tokens["used"] == 20
    b.check_integrity()
    a.check_integrity()


def test_a_longer_request_fetches_only_its_uncached_tail(two) -> None:
    a, b = two
    tokens = list(range(200, 224))
    put(a, tokens)
    settle(a)
    put(b, tokens[:8])  # b computed the first 8 tokens itself
    attached, device = fetch(b, tokens)
    assert attached == 16
    assert b.storage is not None and b.storage.stats.queried_tokens == 16
    pool = pool_of(b)
    assert torch.equal(read_rows(pool, device.tensor), expected_rows(tokens, pool.num_layers))
    b.check_integrity()


def test_a_miss_allocates_no_host_slots_and_counts_not_found(two) -> None:
    _, b = two
    host = b.controller.host_pool.allocator
    before = host.num_free_tokens
    key = b.key(list(range(300, 310)))
    match = b.match(key)
    prefetch = b.prefetch(key, match)
    assert prefetch is not None
    assert b.wait_prefetch(prefetch, timeout_s=5.0)
    assert host.num_free_tokens == before
    assert b.finish_prefetch(prefetch) == 0
    assert b.storage is not None and b.storage.stats.prefetch_tokens["not_found"] == 10
    b.check_integrity()
