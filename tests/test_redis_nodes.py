"""Routing and connections of the Redis store (``RedisNodes``) against real servers: the slot
map read from ``CLUSTER SLOTS`` routes every slot to its master (range ends included), is
asked for at most once per interval, and is asked of the other known masters when the seeds
are gone; a thread keeps its connection until its server fails, and ``close()`` closes every
thread's; a slot moved to another master is followed after its ``MOVED`` reply."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import redis
from storage_helpers import hashes, make_pool, namespace, needs_redis, views

from hicache.bench.redis_local import RedisCluster, RedisServer
from hicache.storage import PageStatus, RedisStore
from hicache.storage.base import Deadline, StatsRecorder
from hicache.storage.redis_nodes import NUM_SLOTS, RedisNodes, key_slot, slot_map

pytestmark = needs_redis
OK, ERROR = PageStatus.OK, PageStatus.ERROR


def nodes_of(addresses: list[tuple[str, int]], *, cluster: bool = True,
             refresh_interval_s: float = 0.2, backoff_s: float = 0.1) -> RedisNodes:
    return RedisNodes(addresses, cluster=cluster, password=None, stats=StatsRecorder(),
                      base_backoff_s=backoff_s, max_backoff_s=backoff_s,
                      refresh_interval_s=refresh_interval_s)


def deadline() -> Deadline:
    return Deadline(5.0)


def tag_in_slot(slot: int) -> bytes:
    """A page-hash tag (hex, as the store makes them) whose key lands in ``slot``."""
    while True:
        tag = os.urandom(32).hex().encode()
        if key_slot(tag) == slot:
            return tag


def slot_ranges(server: RedisServer) -> list[tuple[int, int, tuple[str, int]]]:
    """``(first, last, master)`` of every slot range, as redis-py reads ``CLUSTER SLOTS``."""
    reply = redis.Redis(port=server.port).execute_command("CLUSTER", "SLOTS")
    return [(int(first), int(last), (master[0].decode() or "127.0.0.1", int(master[1])))
            for first, last, master, *_ in reply]


def slots_calls(servers: list[RedisServer]) -> int:
    """``CLUSTER SLOTS`` commands the running ``servers`` have answered so far."""
    total = 0
    for server in servers:
        if server.process is None:
            continue
        stats = redis.Redis(port=server.port).info("commandstats")
        total += int(stats.get("cmdstat_cluster|slots", {}).get("calls", 0))
    return total


def test_slot_map_covers_every_slot_once() -> None:
    """Ranges end inclusive; an empty host is the answering node's; unserved slots None."""
    reply = [[0, 99, [b"10.0.0.1", 7000, b"id1"]],
             [100, 100, [b"", 7001, b"id2"]],
             [200, NUM_SLOTS - 1, [b"10.0.0.3", 7002, b"id3"], [b"10.0.0.9", 7009, b"r"]]]
    owners = slot_map(reply, "10.9.9.9")
    assert len(owners) == NUM_SLOTS
    assert owners[0] == owners[99] == ("10.0.0.1", 7000)
    assert owners[100] == ("10.9.9.9", 7001)
    assert owners[101] is None and owners[199] is None
    assert owners[200] == owners[NUM_SLOTS - 1] == ("10.0.0.3", 7002)
    # in any order (a reply lists ranges node by node)
    assert slot_map([reply[2], reply[1], reply[0]], "10.9.9.9") == owners


def test_every_range_end_routes_to_its_master(redis_cluster: RedisCluster) -> None:
    ranges = slot_ranges(redis_cluster.servers[0])
    assert len(ranges) == 3
    nodes = nodes_of(redis_cluster.addresses)
    try:
        wanted = [(tag_in_slot(slot), master) for first, last, master in ranges
                  for slot in (first, last)]
        groups = nodes.group([tag for tag, _ in wanted], deadline())
        routed = {i: address for address, positions in groups.items() for i in positions}
        assert [routed[i] for i in range(len(wanted))] == [m for _, m in wanted]
        assert nodes.masters(deadline()) == sorted(m for _, _, m in ranges)
    finally:
        nodes.close()


def test_the_slot_map_is_asked_for_at_most_once_per_interval(redis_cluster: RedisCluster
                                                             ) -> None:
    nodes = nodes_of(redis_cluster.addresses, refresh_interval_s=60.0)
    try:
        before = slots_calls(redis_cluster.servers)
        for _ in range(5):
            nodes.masters(deadline())
            nodes.refresh(deadline())
        assert slots_calls(redis_cluster.servers) - before == 1
        nodes.refresh(deadline(), force=True)
        assert slots_calls(redis_cluster.servers) - before == 2
    finally:
        nodes.close()


def test_a_thread_keeps_its_connection_until_its_server_fails(redis_server: RedisServer
                                                              ) -> None:
    """Another thread's failure makes this thread's older connection stale: it is closed
    and replaced (after the circuit's backoff), never reused."""
    nodes = nodes_of([redis_server.address], cluster=False, backoff_s=0.01)
    address = redis_server.address
    try:
        first = nodes.connection(address, deadline())
        assert first is not None and nodes.connection(address, deadline()) is first
        other = threading.Thread(target=nodes.failed, args=(address, OSError("test")))
        other.start()
        other.join()
        time.sleep(0.05)
        second = nodes.connection(address, deadline())
        assert second is not None and second is not first and first.closed
        assert nodes.connection(address, deadline()) is second
    finally:
        nodes.close()


def test_close_closes_the_connections_of_every_thread(redis_server: RedisServer) -> None:
    nodes = nodes_of([redis_server.address], cluster=False)
    made = []

    def connect() -> None:
        made.append(nodes.connection(redis_server.address, deadline()))

    threads = [threading.Thread(target=connect) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    connect()
    assert len({id(c) for c in made}) == 4 and all(c is not None for c in made)
    nodes.close()
    assert all(c is not None and c.closed for c in made)


def test_the_map_is_asked_of_another_master_when_the_seed_is_gone(tmp_path: Path) -> None:
    cluster = RedisCluster(tmp_path).start()
    try:
        seed, *others = cluster.servers
        nodes = nodes_of([seed.address], backoff_s=30.0)
        try:
            assert len(nodes.masters(deadline())) == 3  # the map, from the seed
            seed.kill()
            before = slots_calls(others)
            nodes.refresh(deadline(), force=True)
            assert slots_calls(others) - before == 1
        finally:
            nodes.close()
    finally:
        cluster.stop()


def test_a_page_whose_slot_moved_is_followed_after_its_moved_reply(tmp_path: Path) -> None:
    """Reshard the slot of a stored page to another master (the keys migrated as
    ``redis-cli --cluster reshard`` does): the next get meets MOVED, an error for that page,
    and the one after it routes to the new master and loads the page."""
    cluster = RedisCluster(tmp_path).start()
    try:
        pool = make_pool()
        keys = hashes(1, seed=21)
        with RedisStore(cluster.addresses, namespace(pool), cluster=True, timeout_s=2.0) as store:
            assert store.put(keys, views(pool, 1, 1)).statuses == (OK,)
            key = store.key(keys[0])
            slot = key_slot(keys[0].hex().encode())
            clients = [redis.Redis(port=s.port) for s in cluster.servers]
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
            source = next(i for i, c in enumerate(clients) if c.execute_command(
                "CLUSTER", "COUNTKEYSINSLOT", slot) == 1)
            target = (source + 1) % len(clients)
            clients[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
            clients[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
            clients[source].execute_command("MIGRATE", "127.0.0.1", cluster.servers[target].port,
                                            key, 0, 5000)
            for client in clients:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
            assert clients[target].exists(key) == 1
            assert store.get(keys, views(pool, 5, 1)).statuses == (ERROR,)
            time.sleep(0.25)  # the map's refresh interval
            assert store.get(keys, views(pool, 5, 1)).statuses == (OK,)
    finally:
        cluster.stop()
