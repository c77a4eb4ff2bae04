"""Faults at the storage layer, against real Redis processes: a server killed and restarted, a
cluster master killed, a server that stops answering. Each ends in misses within the deadline
(never a hang, never an exception), is counted, and recovers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import redis
import torch
from storage_helpers import hashes, make_pool, namespace, needs_redis, rows, views

from hicache.bench.redis_local import RedisCluster, RedisServer
from hicache.storage import PageStatus, RedisStore

pytestmark = needs_redis
OK, MISS, TIMEOUT, ERROR = PageStatus.OK, PageStatus.MISS, PageStatus.TIMEOUT, PageStatus.ERROR
TIMEOUT_S = 0.3
BACKOFF_S = 0.05
SLACK_S = 1.0  # scheduling noise on a loaded 2-core machine; a hang would take far longer


def store_for(addresses: list[tuple[str, int]], *, cluster: bool = False) -> RedisStore:
    return RedisStore(addresses, namespace(make_pool()), cluster=cluster, timeout_s=TIMEOUT_S,
                      base_backoff_s=BACKOFF_S, max_backoff_s=BACKOFF_S)


def timed(call):  # type: ignore[no-untyped-def]
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def test_a_killed_server_gives_misses_then_recovers_after_a_restart(
        own_server: RedisServer) -> None:
    """Kill -9: calls return ERROR at once (circuit open); after a restart on the same port
    the store reconnects by itself; the lost pages are misses, new puts work."""
    pool = make_pool()
    keys = hashes(4, seed=10)
    with store_for([own_server.address]) as store:
        assert store.put(keys, views(pool, 1, 4)).statuses == (OK,) * 4
        own_server.kill()
        result, elapsed = timed(lambda: store.get(keys, views(pool, 11, 4)))
        assert set(result.statuses) <= {ERROR, TIMEOUT} and result.error
        assert elapsed < TIMEOUT_S + SLACK_S
        assert store.stats().circuit_opens == 1 and store.stats().open_circuits == 1
        result, elapsed = timed(lambda: store.exists(keys))
        assert result.statuses == (ERROR,) * 4 and elapsed < 0.1  # circuit open: no I/O
        assert result.error is not None and "circuit open" in result.error
        result = store.get(keys, views(pool, 11, 4))  # the striped reads say so too
        assert result.statuses == (ERROR,) * 4
        assert result.error is not None and "circuit open" in result.error
        own_server.start()
        time.sleep(2 * BACKOFF_S)
        assert store.exists(keys).statuses == (MISS,) * 4  # no persistence: data is gone
        assert store.stats().open_circuits == 0
        assert store.put(keys, views(pool, 1, 4)).statuses == (OK,) * 4
        assert store.get(keys, views(pool, 11, 4)).statuses == (OK,) * 4
        assert torch.equal(rows(pool, 11, 4), rows(pool, 1, 4))


def test_a_stopped_server_times_out_within_the_deadline(own_server: RedisServer) -> None:
    """SIGSTOP: the connection stays open but nothing answers; get is TIMEOUT by the
    deadline, and after SIGCONT the next call (after the backoff) succeeds."""
    pool = make_pool()
    keys = hashes(3, seed=11)
    with store_for([own_server.address]) as store:
        store.put(keys, views(pool, 1, 3))
        own_server.pause()
        try:
            result, elapsed = timed(lambda: store.get(keys, views(pool, 11, 3)))
            assert result.statuses == (TIMEOUT,) * 3
            assert TIMEOUT_S * 0.9 < elapsed < TIMEOUT_S + SLACK_S
            assert store.stats().pages_timeout == 3
        finally:
            own_server.resume()
        time.sleep(2 * BACKOFF_S)
        assert store.get(keys, views(pool, 11, 3)).statuses == (OK,) * 3


def test_a_slow_command_times_out_and_the_connection_is_replaced(
        own_server: RedisServer) -> None:
    """DEBUG SLEEP blocks the server for longer than the deadline: exists is TIMEOUT in
    time; once the server is free again a fresh connection answers correctly."""
    keys = hashes(2, seed=12)
    pool = make_pool()
    with store_for([own_server.address]) as store:
        store.put(keys, views(pool, 1, 2))
        blocker = redis.Redis(port=own_server.port)
        blocker.execute_command("CLIENT", "SETNAME", "blocker")
        sleeper = threading.Thread(target=blocker.execute_command, args=("DEBUG", "SLEEP", "1"))
        sleeper.start()
        time.sleep(0.05)
        result, elapsed = timed(lambda: store.exists(keys))
        assert result.statuses == (TIMEOUT, TIMEOUT) and elapsed < TIMEOUT_S + SLACK_S
        sleeper.join()
        time.sleep(2 * BACKOFF_S)
        assert store.exists(keys).statuses == (OK, OK)


def test_a_killed_cluster_master_loses_only_its_pages(tmp_path: Path) -> None:
    """Kill one of three masters: its pages fail within the deadline, the others load; after
    it restarts (empty) its pages are misses and can be stored again."""
    cluster = RedisCluster(tmp_path).start()
    try:
        pool = make_pool(num_pages=32)
        keys = hashes(12, seed=13)
        with store_for(cluster.addresses, cluster=True) as store:
            assert store.put(keys, views(pool, 1, 12)).statuses == (OK,) * 12
            victim = cluster.servers[1]
            on_victim = {i for i, k in enumerate(keys) if _held_by(victim, store.key(k))}
            assert 0 < len(on_victim) < 12
            victim.kill()
            result, elapsed = timed(lambda: store.get(keys, views(pool, 13, 12)))
            assert elapsed < TIMEOUT_S + SLACK_S
            assert {i for i, s in enumerate(result.statuses) if s is not OK} == on_victim
            assert store.stats().circuit_opens >= 1
            victim.start()
            cluster.wait_ok()
            time.sleep(2 * BACKOFF_S)
            expected = tuple(MISS if i in on_victim else OK for i in range(12))
            assert store.exists(keys).statuses == expected
            assert store.put(keys, views(pool, 1, 12)).statuses == (OK,) * 12
            assert store.get(keys, views(pool, 13, 12)).statuses == (OK,) * 12
            assert torch.equal(rows(pool, 13, 12), rows(pool, 1, 12))
    finally:
        cluster.stop()


def _held_by(server: RedisServer, key: bytes) -> bool:
    """True if ``server`` holds ``key`` (another master answers MOVED)."""
    try:
        return bool(redis.Redis(port=server.port).exists(key))
    except redis.exceptions.MovedError:
        return False
