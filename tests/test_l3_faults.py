"""Faults under the cache's shared-store tier: corrupt pages on disk and in Redis, another
model revision, a Redis server killed, restarted and paused, a cluster; each ends in counted
misses within the deadline, never a corrupt row loaded, never a hang, and slot conservation."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from radix_helpers import expected_rows, read_rows
from storage_helpers import needs_redis
from test_l3_tier import MODEL, fetch, make_config, pool_of, put, settle

from hicache.bench.redis_local import RedisCluster, RedisServer
from hicache.config import HiCacheConfig, config_from_dict
from hicache.factory import build_service
from hicache.service import HiCacheService

TOKENS = list(range(500, 520))  # 10 pages of 2


def redis_config(url: str, **storage: object) -> HiCacheConfig:
    base = make_config(Path("unused"))
    raw = {
        "page_size_tokens": base.page_size_tokens,
        "model": {"num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": 32, "device": "cpu"},
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 60.0},
        "storage": {"backend": "redis", "url": url, "prefetch_policy": "wait_complete",
                    "prefetch_threshold_tokens": 0, "timeout_s": 0.5, **storage},
    }
    return config_from_dict(raw)


def rows_match(service: HiCacheService, tokens: list[int], attached: int,
               device: torch.Tensor) -> None:
    pool = pool_of(service)
    assert len(device) >= attached
    assert torch.equal(read_rows(pool, device), expected_rows(tokens[:len(device)],
                                                              pool.num_layers))


def stored_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix == ".kv")


def test_a_corrupt_page_on_disk_ends_the_prefetch_there(tmp_path: Path) -> None:
    a = build_service(make_config(tmp_path / "l3"), **MODEL)
    b = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        put(a, TOKENS)
        settle(a)
        files = stored_files(tmp_path / "l3")
        assert len(files) == 10
        # flip one byte in the payload of one page (which one does not matter: the
        # prefetch uses the pages before the first bad one)
        victim = files[3]
        data = bytearray(victim.read_bytes())
        data[-5] ^= 0x40
        victim.write_bytes(bytes(data))
        attached, device = fetch(b, TOKENS)
        assert b.storage is not None
        stats, store = b.storage.stats, b.storage.store.stats()
        assert store.pages_corrupt == 1
        assert stats.prefetch_tokens["corrupt"] == 2
        assert attached < len(TOKENS)
        rows_match(b, TOKENS, attached, device.tensor)
        assert not victim.exists(), "a corrupt object is deleted"
        b.check_integrity()
    finally:
        a.stop()
        b.stop()


def test_a_truncated_page_is_a_miss(tmp_path: Path) -> None:
    a = build_service(make_config(tmp_path / "l3"), **MODEL)
    b = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        put(a, TOKENS)
        settle(a)
        first = stored_files(tmp_path / "l3")
        for path in first:
            os.truncate(path, path.stat().st_size // 2)
        attached, _ = fetch(b, TOKENS)
        assert attached == 0
        assert b.storage is not None and b.storage.store.stats().pages_corrupt >= 1
        b.check_integrity()
    finally:
        a.stop()
        b.stop()


def test_another_model_revision_finds_nothing(tmp_path: Path) -> None:
    a = build_service(make_config(tmp_path / "l3"), **MODEL)
    b = build_service(make_config(tmp_path / "l3"), model_id="test/model", model_revision="r2")
    try:
        put(a, TOKENS)
        settle(a)
        attached, _ = fetch(b, TOKENS)
        assert attached == 0
        assert b.storage is not None
        assert b.storage.stats.prefetch_tokens["not_found"] == len(TOKENS)
    finally:
        a.stop()
        b.stop()


def test_the_file_store_at_its_cap_keeps_serving(tmp_path: Path) -> None:
    page_bytes = 2 * 2 * 1 * 2 * 4  # page of 2 tokens x K,V x 2 layers x 2 floats
    cap_gib = 6 * (page_bytes + 4096) / 2**30  # room for a few page objects only
    config = make_config(tmp_path / "l3", size_cap_gib=cap_gib)
    a = build_service(config, **MODEL)
    b = build_service(config, **MODEL)
    try:
        for start in range(0, 200, 20):
            put(a, list(range(start + 5000, start + 5020)))
            settle(a)
            a.evict(10**6)
            a.step()
        assert a.storage is not None and a.storage.store.stats().pages_evicted > 0
        attached, device = fetch(b, list(range(5180, 5200)))
        rows_match(b, list(range(5180, 5200)), attached, device.tensor)
        b.check_integrity()
    finally:
        a.stop()
        b.stop()


def services_on(server: RedisServer) -> tuple[HiCacheService, HiCacheService]:
    """Two services (two engine processes) sharing ``server`` as their store."""
    url = "redis://{}:{}".format(*server.address)
    return build_service(redis_config(url), **MODEL), build_service(redis_config(url), **MODEL)


@needs_redis
def test_redis_killed_restarted_and_paused(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    a, b = services_on(server)
    try:
        put(a, TOKENS)
        settle(a)
        attached, device = fetch(b, TOKENS)
        assert attached == len(TOKENS)
        rows_match(b, TOKENS, attached, device.tensor)

        server.kill()  # a dead server: misses within the deadline, backups fail, no hang
        other = list(range(700, 720))
        put(a, other)
        settle(a, timeout_s=20.0)
        assert a.storage is not None and a.storage.stats.backup_pages["failed"] > 0
        assert not any(n.in_storage for n in a.tree.nodes() if n.tokens[:1] == (700,))
        started = time.monotonic()
        attached, _ = fetch(b, other)
        assert attached == 0 and time.monotonic() - started < 5.0

        server.start()  # the same port again: the circuit closes after its backoff
        deadline = time.monotonic() + 20.0
        third = list(range(900, 920))
        while True:
            put(a, third)
            settle(a, timeout_s=20.0)
            if all(n.in_storage for n in a.tree.nodes() if n.tokens[:1] == (900,)):
                break
            assert time.monotonic() < deadline, "backups never reached the restarted server"
            a.evict(10**6)
            a.evict_host(10**6)
            a.step()
            time.sleep(0.2)

        server.pause()  # a server that does not answer: timeouts, no hang
        started = time.monotonic()
        attached, _ = fetch(b, list(range(1100, 1120)))
        assert attached == 0 and time.monotonic() - started < 5.0
        server.resume()
        a.check_integrity()
        b.check_integrity()
    finally:
        server.resume()
        a.stop()
        b.stop()
        server.stop()


@needs_redis
def test_two_instances_share_pages_through_a_cluster(redis_cluster: RedisCluster) -> None:
    a = build_service(redis_config(redis_cluster.url), **MODEL)
    b = build_service(redis_config(redis_cluster.url), **MODEL)
    try:
        tokens = list(range(1300, 1324))
        put(a, tokens)
        settle(a)
        attached, device = fetch(b, tokens)
        assert attached == len(tokens)
        rows_match(b, tokens, attached, device.tensor)
        b.check_integrity()
    finally:
        a.stop()
        b.stop()
