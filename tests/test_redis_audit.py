"""Audit of the Redis store against real servers (each test starts and stops its own).

- A connection the server had closed (its idle ``timeout``, a restart) was reused: every
  page ERROR, the circuit of a server that answers opened, the next calls refused too.
- One ``ASK``/``MOVED`` reply in a pipelined ``EXISTS`` (a slot being migrated) failed the
  whole master: its other pages ERROR and its circuit opened.
- A value of another type at a page's key (``WRONGTYPE``) was an ERROR on every read and
  never removed, and a put skipped it: the page could never be read or stored again. It is
  now CORRUPT, counted, deleted and stored again.
- A page's own error reply (``OOM`` under ``maxmemory``, ``NOAUTH``) left the call's error
  empty: the tier's warning said "not stored" without the server's reason.
- A prefetch whose read stopped at a damaged page counted every page after it as
  ``timeout``, though no deadline passed: they are ``after_failure`` now.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import redis
import torch
from storage_helpers import hashes, make_pool, namespace, needs_redis, rows, views
from test_l3_faults import TOKENS, redis_config
from test_l3_tier import MODEL, fetch, put, settle

from hicache.bench.redis_local import RedisCluster, RedisServer
from hicache.factory import build_service
from hicache.storage import PageStatus, RedisStore, open_store
from hicache.storage.base import Deadline
from hicache.storage.redis_nodes import key_slot

OK, MISS, CORRUPT, ERROR = PageStatus.OK, PageStatus.MISS, PageStatus.CORRUPT, PageStatus.ERROR


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    started = RedisServer(tmp_path / "redis").start()
    yield started
    started.stop()


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    started = RedisCluster(tmp_path / "cluster").start()
    yield started
    started.stop()


@needs_redis
def test_a_connection_the_server_closed_while_idle_is_not_a_failure(server: RedisServer) -> None:
    redis.Redis(port=server.port).config_set("timeout", "1")  # close clients idle 1 s
    pool = make_pool()
    keys = hashes(4, seed=1)
    with RedisStore([server.address], namespace(pool), timeout_s=2.0) as store:
        assert store.put(keys, views(pool, 1, 4)).statuses == (OK,) * 4
        time.sleep(2.5)  # the server drops this store's connections
        found = store.exists(keys)
        assert found.statuses == (OK,) * 4, found
        got = store.get(keys, views(pool, 10, 4))
        assert got.statuses == (OK,) * 4, got
        assert store.stats().circuit_opens == 0


@needs_redis
def test_a_restart_between_put_and_prefetch_reads_misses_not_errors(server: RedisServer) -> None:
    pool = make_pool()
    keys = hashes(4, seed=2)
    with RedisStore([server.address], namespace(pool), timeout_s=2.0) as store:
        assert store.put(keys, views(pool, 1, 4)).statuses == (OK,) * 4
        server.kill()
        server.start()  # same port, no persistence: the pages are gone, the server answers
        found = store.exists(keys)
        assert found.statuses == (MISS,) * 4, found
        assert store.stats().circuit_opens == 0


def owner(store: RedisStore, page_hash: bytes) -> tuple[str, int]:
    (address,) = store.nodes.group([page_hash.hex().encode()], Deadline(2.0))
    assert address is not None
    return address


def start_migrating(cluster: RedisCluster, slot: int, source: int) -> None:
    """``CLUSTER SETSLOT`` as the first step of ``redis-cli --cluster reshard``."""
    clients = [redis.Redis(port=s.port) for s in cluster.servers]
    ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
    target = (source + 1) % len(clients)
    clients[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
    clients[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])


@needs_redis
def test_an_ask_reply_to_one_exists_fails_only_that_page(cluster: RedisCluster) -> None:
    pool = make_pool()
    keys = hashes(20, seed=5)
    with RedisStore(cluster.addresses, namespace(pool), cluster=True, timeout_s=2.0,
                    base_backoff_s=5.0, max_backoff_s=5.0) as store:
        stored, fresh = keys[:10], keys[10:]
        assert store.put(stored, views(pool, 1, 10)).statuses == (OK,) * 10
        # a page not stored yet whose master also holds a stored page (other slot)
        new = next(h for h in fresh
                   if any(owner(store, s) == owner(store, h) for s in stored))
        old = next(s for s in stored if owner(store, s) == owner(store, new))
        assert key_slot(new.hex().encode()) != key_slot(old.hex().encode())
        source = next(i for i, s in enumerate(cluster.servers) if s.address == owner(store, new))
        start_migrating(cluster, key_slot(new.hex().encode()), source)

        result = store.exists([new, old])  # 'new': ASK (the slot is migrating, key absent)
        assert result.statuses[1] is OK, result
        assert store.stats().circuit_opens == 0
        assert store.exists([old]).statuses == (OK,)
        # a put of pages on that master (none in the migrating slot) is refused too
        others = [h for h in fresh if h != new and owner(store, h) == owner(store, new)
                  and key_slot(h.hex().encode()) != key_slot(new.hex().encode())]
        assert others
        put = store.put(others, views(pool, 11, len(others)))
        assert put.statuses == (OK,) * len(others), put


@needs_redis
def test_a_value_of_another_type_is_corrupt_deleted_and_stored_again(server: RedisServer) -> None:
    pool = make_pool()
    keys = hashes(2, seed=7)
    with RedisStore([server.address], namespace(pool), timeout_s=2.0) as store:
        redis.Redis(port=server.port).rpush(store.key(keys[0]), b"not a page")
        got = store.get(keys, views(pool, 5, 2))
        assert got.statuses == (CORRUPT, MISS), got
        assert store.stats().pages_corrupt == 1
        assert store.exists(keys[:1]).statuses == (MISS,)  # deleted; actual: OK (kept)
        put = store.put(keys, views(pool, 1, 2))
        assert put.statuses == (OK, OK) and store.stats().pages_written == 2
        assert store.get(keys, views(pool, 5, 2)).statuses == (OK, OK)
        assert torch.equal(rows(pool, 5, 2), rows(pool, 1, 2))


@needs_redis
@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru"])
def test_an_oom_reply_to_a_put_is_the_calls_error(server: RedisServer, policy: str) -> None:
    admin = redis.Redis(port=server.port)
    admin.config_set("maxmemory-policy", policy)
    admin.config_set("maxmemory", "1")  # full: every write is refused with -OOM
    pool = make_pool()
    keys = hashes(3, seed=4)
    with RedisStore([server.address], namespace(pool), timeout_s=2.0) as store:
        result = store.put(keys, views(pool, 1, 3))
        assert result.statuses == (ERROR,) * 3  # counted as failures, no crash: fine
        assert result.error is not None and "OOM" in result.error, result


@needs_redis
def test_a_noauth_reply_to_a_get_is_the_calls_error(server: RedisServer) -> None:
    redis.Redis(port=server.port).config_set("requirepass", "secret")
    pool = make_pool()
    keys = hashes(3, seed=4)
    with open_store("redis://{}:{}".format(*server.address), namespace(pool),
                    timeout_s=2.0) as store:  # no password in the URL
        result = store.get(keys, views(pool, 5, 3))
        assert result.statuses == (ERROR,) * 3
        assert result.error is not None and "NOAUTH" in result.error, result


@needs_redis
def test_the_tiers_warning_names_the_servers_reason(server: RedisServer,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The same through a service: the one WARNING of failing puts must say OOM."""
    admin = redis.Redis(port=server.port)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    service = build_service(redis_config("redis://{}:{}".format(*server.address)), **MODEL)
    try:
        with caplog.at_level(logging.WARNING, logger="hicache.l3"):
            put(service, TOKENS)
            settle(service)
        assert service.storage is not None
        assert service.storage.stats.backup_pages["failed"] == len(TOKENS) // 2
        warnings = [r.getMessage() for r in caplog.records if "puts failed" in r.getMessage()]
        assert warnings and "OOM" in warnings[0], warnings
    finally:
        service.stop()


@needs_redis
def test_pages_after_a_corrupt_one_are_not_timeouts(server: RedisServer) -> None:
    url = "redis://{}:{}".format(*server.address)
    a = build_service(redis_config(url), **MODEL)
    b = build_service(redis_config(url), **MODEL)  # prefetch_policy wait_complete
    try:
        stored: list[bytes] = []
        assert a.storage is not None and b.storage is not None
        a.storage.observers.append(
            lambda event, hashes, *_: stored.extend(hashes) if event == "put" else None)
        put(a, TOKENS)  # 10 pages of 2 tokens
        settle(a)
        assert len(stored) == 10
        redis.Redis(port=server.port).set(b.storage.store.key(stored[2]), b"damaged")
        attached, _ = fetch(b, TOKENS)
        counts = b.storage.stats.prefetch_tokens
        assert attached == 4 and counts["used"] == 4 and counts["corrupt"] == 2
        assert counts["after_failure"] == 14 and counts["timeout"] == 0, dict(counts)
        assert sum(counts.values()) == len(TOKENS)
    finally:
        a.stop()
        b.stop()
