"""The shared store (L3) inside the cache: backups from host slots to the store, prefetches
from it into host slots, load-backs of what arrived, checked row by row on the CPU, with the
real file store in a temporary directory (Redis in tests/test_l3_redis.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from radix_helpers import expected_rows, read_rows, write_rows

from hicache.config import HiCacheConfig, SWAHistory, config_from_dict
from hicache.factory import build_service
from hicache.pools import DeviceKVPool, HybridSWAPool, IndexSpace, Indices
from hicache.service import HiCacheService

PAGE = 2
MODEL = {"model_id": "test/model", "model_revision": "r1"}


def make_config(path: Path, *, policy: str = "write_through", prefetch: str = "wait_complete",
                threshold: int = 0, device_tokens: int = 32, hybrid: bool = False,
                swa_history: str = "all", **storage: Any) -> HiCacheConfig:
    """A 2-layer model (layer 1 a 3-token sliding window when ``hybrid``) on the CPU, a
    host twice the device, a file store at ``path``."""
    model: dict[str, Any] = {"num_layers": 2, "attention": "mha", "num_kv_heads": 1,
                             "head_dim": 2, "dtype": "float32"}
    pool: dict[str, Any] = {"num_tokens": device_tokens, "device": "cpu"}
    host: dict[str, Any] = {"ratio": 2.0, "ram_reserve_gib": 0.0}
    if hybrid:
        model.update(swa_layers=[1], window_tokens=3)
        pool["swa_num_tokens"] = device_tokens
        host["swa_history"] = swa_history
    return config_from_dict({
        "page_size_tokens": PAGE,
        "model": model,
        "device_pool": pool,
        "host": host,
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 60.0},
        "storage": {"backend": "file", "path": str(path), "write_policy": policy,
                    "prefetch_policy": prefetch, "prefetch_threshold_tokens": threshold,
                    **storage},
    })


def pool_of(service: HiCacheService) -> DeviceKVPool:
    """The full-attention device pool (of a hybrid pool: its full part)."""
    pool = service.device_pool
    return pool.full if isinstance(pool, HybridSWAPool) else pool


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
    assert prefetch.num_tokens == 10
    assert b.wait_prefetch(prefetch, timeout_s=5.0)
    assert prefetch.found_tokens == 0
    assert host.num_free_tokens == before
    assert b.finish_prefetch(prefetch) == 0
    assert b.storage is not None and b.storage.stats.prefetch_tokens["not_found"] == 10
    b.check_integrity()


def test_bad_calls_name_what_is_wrong_and_change_nothing(tmp_path: Path) -> None:
    service = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        key = service.key(list(range(40, 50)))
        match = service.match(key)
        with pytest.raises(TypeError, match="MatchResult"):
            service.prefetch(key, match.last_host_node)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="Prefetch from prefetch"):
            service.prefetch_ready(match)  # type: ignore[arg-type]
        prefetch = service.prefetch(key, match)
        assert prefetch is not None
        assert service.wait_prefetch(prefetch, timeout_s=5.0)
        service.finish_prefetch(prefetch)
        with pytest.raises(ValueError, match="finished already"):
            service.finish_prefetch(prefetch)
        with pytest.raises(ValueError, match="finished already"):
            service.prefetch_ready(prefetch)
        service.check_integrity()
    finally:
        service.stop()


def test_a_stale_match_is_refused(tmp_path: Path) -> None:
    service = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        tokens = list(range(60, 70))
        put(service, tokens)
        settle(service)
        key = service.key([*tokens, 71, 72, 73, 74])
        match = service.match(key)
        whole = service.key(tokens[:8])  # nothing after the match: no prefetch to start
        whole_match = service.match(whole)
        service.evict(10**6)
        service.evict_host(10**6)  # the matched node is gone
        with pytest.raises(ValueError, match="removed from the tree"):
            service.prefetch(key, match)
        with pytest.raises(ValueError, match="removed from the tree"):  # refused, not None
            service.prefetch(whole, whole_match)
        assert service.storage is not None and not service.storage.prefetches.open_prefetches()
        service.check_integrity()
    finally:
        service.stop()


@pytest.mark.parametrize("names", [{}, {"model_id": "m"}, {"model_revision": "r"},
                                   {"model_id": "", "model_revision": "r"}],
                         ids=["neither", "no-revision", "no-id", "empty-id"])
def test_a_service_needs_the_model_to_name_its_pages(tmp_path: Path,
                                                    names: dict[str, str]) -> None:
    """Both names, or the pages of one model's weights could be read by another's."""
    with pytest.raises(ValueError, match="pass model_id and model_revision"):
        build_service(make_config(tmp_path / "l3"), **names)


def test_without_a_store_prefetch_is_none(tmp_path: Path) -> None:
    raw = make_config(tmp_path / "l3")
    from dataclasses import replace

    from hicache.config.storage import StorageConfig
    service = build_service(replace(raw, storage=StorageConfig()))
    try:
        key = service.key(list(range(10)))
        assert service.prefetch(key, service.match(key)) is None
    finally:
        service.stop()


def test_stop_finishes_prefetches_in_flight(two) -> None:
    a, b = two
    tokens = list(range(800, 820))
    put(a, tokens)
    settle(a)
    key = b.key(tokens)
    prefetch = b.prefetch(key, b.match(key))
    assert prefetch is not None
    b.stop()  # never finished by the engine: stop finishes it
    assert prefetch.finished
    b.check_integrity()
    assert not any(n.lock_count for n in b.tree.nodes())


def test_write_back_stores_a_host_leaf_before_it_leaves(tmp_path: Path) -> None:
    a = build_service(make_config(tmp_path / "l3", policy="write_back"), **MODEL)
    b = build_service(make_config(tmp_path / "l3", policy="write_back"), **MODEL)
    try:
        tokens = list(range(900, 910))
        put(a, tokens)
        settle(a)
        assert a.storage is not None and a.storage.stats.backup_pages["stored"] == 0
        a.evict(10**6)
        a.step()
        assert a.evict_host(10**6) == 0  # queued for the store first
        settle(a)
        assert a.storage.stats.backup_pages["stored"] == 5
        assert not list(a.tree.nodes()), "the leaf left once it was stored"
        attached, device = fetch(b, tokens)
        assert attached == 10
        pool = pool_of(b)
        assert torch.equal(read_rows(pool, device.tensor), expected_rows(tokens, pool.num_layers))
        a.check_integrity()
    finally:
        a.stop()
        b.stop()


def test_selective_backups_wait_for_hits(tmp_path: Path) -> None:
    service = build_service(make_config(tmp_path / "l3", policy="write_through_selective",
                                         write_through_hits=2), **MODEL)
    try:
        tokens = list(range(950, 960))
        put(service, tokens)
        settle(service)
        tier = service.storage
        assert tier is not None and tier.stats.backup_pages["stored"] == 0
        service.match(tokens)
        settle(service)
        assert tier.stats.backup_pages["stored"] == 0
        service.match(tokens)
        settle(service)
        assert tier.stats.backup_pages["stored"] == 5
    finally:
        service.stop()


def test_pages_below_a_partial_prefetch_are_stored_under_their_chain_hashes(two) -> None:
    """A prefetch that found fewer pages than it asked for gives the tree the hashes of
    the pages that arrived only: pages computed below them are stored under the right
    chain, so another instance finds them."""
    a, b = two
    tokens = list(range(500, 516))
    put(a, tokens[:4])  # the store gets pages 0-1
    settle(a)
    attached, _ = fetch(b, tokens[:8])  # asks for pages 0-3, finds 0-1
    assert attached == 4
    node = b.match(tokens[:4]).last_host_node
    assert node.page_hashes is not None
    assert len(node.page_hashes) == node.num_tokens // PAGE * 32
    put(b, tokens[:8])  # b computes pages 2-3 and backs them up
    settle(b)
    a.evict(10**6)
    a.step()
    a.evict_host(10**6)
    attached, _ = fetch(a, tokens[:8])
    assert attached == 8


def test_a_hybrid_model_shares_pages_with_their_sliding_window_rows(tmp_path: Path) -> None:
    """Pages go to the store with their SWA rows, come back into full and SWA host slots,
    and load back with the window's SWA rows (no swa_tail_missing refusal)."""
    a = build_service(make_config(tmp_path / "l3", hybrid=True), **MODEL)
    b = build_service(make_config(tmp_path / "l3", hybrid=True), **MODEL)
    try:
        tokens = list(range(1500, 1512))
        put(a, tokens)
        settle(a)
        assert a.storage is not None and a.storage.stats.backup_pages["stored"] == 6
        attached, device = fetch(b, tokens)
        assert attached == 12
        pool = pool_of(b)
        assert torch.equal(read_rows(pool, device.tensor), expected_rows(tokens, pool.num_layers))
        assert not b.tree.stats.refused_load_backs
        node = b.match(tokens).last_host_node
        assert node.host_swa is None or bool((node.host_swa.tensor != 0).all())
        b.check_integrity()
        a.check_integrity()
    finally:
        a.stop()
        b.stop()


def test_a_hybrid_store_needs_every_page_s_sliding_window_rows(tmp_path: Path) -> None:
    """Refused when the config is loaded, and by build_service for a config made by hand."""
    with pytest.raises(ValueError, match="swa_history: all"):
        make_config(tmp_path / "l3", hybrid=True, swa_history="window_tails")
    config = make_config(tmp_path / "l3", hybrid=True)
    by_hand = dataclasses.replace(
        config, host=dataclasses.replace(config.host, swa_history=SWAHistory.WINDOW_TAILS))
    with pytest.raises(ValueError, match="swa_history: all"):
        build_service(by_hand, **MODEL)
    assert not (tmp_path / "l3").exists()
