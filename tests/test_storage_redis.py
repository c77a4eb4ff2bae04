"""The Redis store against real servers: a standalone one and a 3-master cluster."""

from __future__ import annotations

import pytest
import redis
import torch
from storage_helpers import (
    check_each_call_timed,
    fill,
    hashes,
    make_pool,
    namespace,
    needs_redis,
    rows,
    views,
)

from hicache.bench.redis_local import RedisCluster, RedisServer
from hicache.pools import HostLayout
from hicache.storage import PageStatus, RedisStore, open_store
from hicache.storage.redis_nodes import key_slot

pytestmark = needs_redis
OK, MISS, CORRUPT = PageStatus.OK, PageStatus.MISS, PageStatus.CORRUPT


def standalone(server: RedisServer, revision: str = "r1",
               layout: HostLayout = HostLayout.PAGE_FIRST) -> RedisStore:
    store = open_store(f"redis://127.0.0.1:{server.port}", namespace(make_pool(layout),
                                                                      revision))
    assert isinstance(store, RedisStore)
    return store


@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST, HostLayout.LAYER_FIRST])
def test_pages_round_trip_through_a_server(redis_server: RedisServer,
                                           layout: HostLayout) -> None:
    """put then get into other slots: bit for bit, neighbouring slots untouched."""
    pool = make_pool(layout)
    keys = hashes(6, seed=1)
    with standalone(redis_server, layout=layout) as store:
        assert store.put(keys, views(pool, 1, 6)).statuses == (OK,) * 6
        fill(pool, 10, 8, 5.0)
        assert store.get(keys, views(pool, 11, 6)).statuses == (OK,) * 6
        assert torch.equal(rows(pool, 11, 6), rows(pool, 1, 6))
        assert (rows(pool, 10, 1) == 5.0).all() and (rows(pool, 17, 1) == 5.0).all()
        store.clear()


def test_exists_put_skip_and_delete(redis_server: RedisServer) -> None:
    """exists marks the gap, put skips stored pages, delete says what was there."""
    pool = make_pool()
    keys = hashes(4, seed=2)
    with standalone(redis_server) as store:
        store.put([keys[0], keys[1], keys[3]], views(pool, 1, 3))
        assert store.exists(keys).statuses == (OK, OK, MISS, OK)
        assert store.put(keys, views(pool, 1, 4)).statuses == (OK,) * 4
        assert (store.stats().pages_written, store.stats().pages_skipped) == (4, 3)
        assert store.delete(keys[:2]).statuses == (OK, OK)
        assert store.delete(keys[:1]).statuses == (MISS,)
        assert store.exists(keys).num_leading_ok == 0
        store.clear()


def test_a_page_another_writer_stores_first_is_ok_and_counted_skipped(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines storing one page: the other one's SET lands between this put's EXISTS
    (a miss) and its SET NX, which then finds the key. The page is OK, counted skipped,
    not written, its bytes not counted, and the value is the other writer's."""
    pool = make_pool()
    keys = hashes(2, seed=9)
    with standalone(redis_server) as store, standalone(redis_server) as other:
        send_sets = store.pages.put

        def other_writer_first(*args: object, **kwargs: object) -> None:
            assert other.put(keys[:1], views(pool, 1, 1)).statuses == (OK,)
            send_sets(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(store.pages, "put", other_writer_first)
        assert store.put(keys, views(pool, 1, 2)).statuses == (OK, OK)
        stats = store.stats()
        assert (stats.pages_written, stats.pages_skipped) == (1, 1)
        assert stats.bytes_written == other.stats().bytes_written > 0
        fill(pool, 11, 2, 3.0)
        assert store.get(keys, views(pool, 11, 2)).statuses == (OK, OK)
        assert torch.equal(rows(pool, 11, 2), rows(pool, 1, 2))
        store.clear()


@pytest.mark.parametrize("damage", ["bit flip", "truncated", "header", "empty"])
def test_a_damaged_value_is_corrupt_never_loaded_and_deleted(redis_server: RedisServer,
                                                             damage: str) -> None:
    """A bit flip, a truncated or empty value or a foreign header is CORRUPT and the key
    removed."""
    pool = make_pool()
    keys = hashes(3, seed=3)
    client = redis.Redis(port=redis_server.port)
    with standalone(redis_server) as store:
        store.put(keys, views(pool, 1, 3))
        key = store.key(keys[1])
        value = bytearray(client.get(key) or b"")
        if damage == "bit flip":
            value[-10] ^= 0x04
        elif damage == "truncated":
            value = value[:-100]
        elif damage == "empty":
            value = bytearray()
        else:
            value[:4] = b"XXXX"
        client.set(key, bytes(value))
        fill(pool, 11, 3, 9.0)
        result = store.get(keys, views(pool, 11, 3))
        assert result.statuses == (OK, CORRUPT, OK) and store.stats().pages_corrupt == 1
        assert client.exists(key) == 0
        assert store.get(keys[:1], views(pool, 11, 1)).statuses == (OK,)  # connection fine
        store.clear()


def test_another_model_revision_misses(redis_server: RedisServer) -> None:
    """Pages stored under revision r1 are misses for r2, and clear(r2) keeps them."""
    pool = make_pool()
    keys = hashes(2, seed=4)
    with standalone(redis_server, "r1") as old, standalone(redis_server, "r2") as new:
        old.put(keys, views(pool, 1, 2))
        assert new.exists(keys).statuses == (MISS, MISS)
        assert new.get(keys, views(pool, 11, 2)).statuses == (MISS, MISS)
        assert new.clear() == 0 and old.clear() == 2


def test_cluster_pages_spread_over_every_master(redis_cluster: RedisCluster) -> None:
    """Each page maps to one slot by its hash tag; 48 pages land on all three masters."""
    pool = make_pool()
    keys = hashes(20, seed=5) + hashes(28, seed=6)
    store = open_store(redis_cluster.url, namespace(pool))
    assert isinstance(store, RedisStore)
    with store:
        for key in keys[:3]:
            server_slot = redis.Redis(port=redis_cluster.servers[0].port).cluster(
                "keyslot", store.key(key).decode())
            assert key_slot(key.hex().encode()) == int(server_slot)
        views_per_page = views(pool, 1, 20) + views(pool, 1, 20) + views(pool, 1, 8)
        assert store.put(keys, views_per_page).statuses == (OK,) * 48
        sizes = [redis.Redis(port=s.port).dbsize() for s in redis_cluster.servers]
        assert sum(sizes) == 48 and min(sizes) > 0
        assert store.exists(keys).num_leading_ok == 48
        assert store.get(keys[:20], views(pool, 1, 20)).statuses == (OK,) * 20
        assert store.clear() == 48


def test_cluster_round_trip_is_bit_exact(redis_cluster: RedisCluster) -> None:
    """Pages read back from the cluster equal what was stored."""
    pool = make_pool(HostLayout.LAYER_FIRST)
    keys = hashes(8, seed=7)
    with open_store(redis_cluster.url, namespace(pool, "cl")) as store:
        store.put(keys, views(pool, 1, 8))
        fill(pool, 11, 8, 1.0)
        assert store.get(keys, views(pool, 11, 8)).statuses == (OK,) * 8
        assert torch.equal(rows(pool, 11, 8), rows(pool, 1, 8))
        store.clear()


def test_each_call_is_counted_once_with_its_own_time(redis_server: RedisServer) -> None:
    with standalone(redis_server) as store:
        check_each_call_timed(store, make_pool(), hashes(3, seed=7))
        store.clear()


def test_a_pipeline_of_one_page_is_taken_and_none_is_refused(redis_server: RedisServer
                                                             ) -> None:
    pool = make_pool()
    keys = hashes(3, seed=8)
    ns = namespace(pool)
    with RedisStore([("127.0.0.1", redis_server.port)], ns, pipeline_pages=1) as store:
        assert store.put(keys, views(pool, 1, 3)).statuses == (OK,) * 3
        assert store.get(keys, views(pool, 5, 3)).statuses == (OK,) * 3
        assert torch.equal(rows(pool, 5, 3), rows(pool, 1, 3))
        store.clear()
    with pytest.raises(ValueError, match="pipeline_pages must be >= 1, got 0"):
        RedisStore([("127.0.0.1", redis_server.port)], ns, pipeline_pages=0)


def test_reads_count_their_bytes_deletes_their_pages_and_a_get_refuses_read_only(
        redis_server: RedisServer) -> None:
    pool = make_pool()
    keys = hashes(3, seed=9)
    with standalone(redis_server) as store:
        assert store.put(keys, views(pool, 1, 3)).statuses == (OK,) * 3
        read_only = [[segment.toreadonly() for segment in page] for page in views(pool, 5, 3)]
        with pytest.raises(ValueError, match="read-only"):
            store.get(keys, read_only)
        assert store.get(keys, views(pool, 5, 3)).statuses == (OK,) * 3
        assert store.stats().bytes_read == 3 * store.format.payload_len
        assert store.delete(keys[:2] + hashes(1, seed=10)).statuses == (OK, OK, MISS)
        assert store.stats().delete_calls == 1 and store.stats().pages_deleted == 2
        store.clear()
