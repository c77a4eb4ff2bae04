"""What each ``storage.write_policy`` puts to the shared store, and what a put leaves on the
host: ``write_through`` and ``write_through_selective`` keep the host copy after the put,
put a node once (not again while in flight or once stored), and the selective policy puts
nothing below its hits and lets such a node leave the host without a put; ``write_back``
with its backup queue full drops the put (counted) and evicts the node from the host as if
there were no store (CPU, the real file store in a temporary directory, puts held at a gate
where the timing matters)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gated_store import GatedFileStore, gated_service
from test_l3_tier import MODEL, make_config, put

from hicache.radix.node import TreeNode
from hicache.service import HiCacheService

X, Y, Z = list(range(100, 104)), list(range(200, 204)), list(range(300, 304))


def host_backups_done(service: HiCacheService) -> None:
    """Step until the host backups are acknowledged (puts to the store may go on)."""
    deadline = time.monotonic() + 10.0
    while True:
        service.step()
        if service.controller.num_in_flight == 0 and not service.tree.has_queued_backups:
            return
        assert time.monotonic() < deadline, "host backups did not finish"
        time.sleep(0.002)


def puts_done(service: HiCacheService, stored_pages: int) -> None:
    """Step until ``stored_pages`` pages in all were stored and no put is in flight."""
    assert service.storage is not None
    deadline = time.monotonic() + 10.0
    while (service.storage.stats.backup_pages["stored"] < stored_pages
           or any(node.store_op is not None for node in service.tree.nodes())):
        assert time.monotonic() < deadline, "the puts did not come back"
        time.sleep(0.002)
        service.step()


def node_of(service: HiCacheService, tokens: list[int]) -> TreeNode:
    """The one node whose own tokens are ``tokens``."""
    (node,) = [n for n in service.tree.nodes() if n.tokens == tuple(tokens)]
    return node


def host_hit(service: HiCacheService, tokens: list[int]) -> int:
    return service.match(service.key(tokens)).host_hit_tokens


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """``build(policy, **storage)``: a gated service; all are stopped at the end."""
    made: list[tuple[HiCacheService, GatedFileStore]] = []

    def make(policy: str, **storage: object) -> tuple[HiCacheService, GatedFileStore]:
        made.append(gated_service(monkeypatch, make_config(tmp_path / "l3", policy=policy,
                                                           **storage), MODEL))
        return made[-1]

    yield make
    for service, store in made:
        store.gate.set()
        service.stop()


def test_write_through_keeps_the_host_copy_of_a_node_that_left_the_device(build) -> None:
    service, store = build("write_through")
    put(service, X)
    host_backups_done(service)
    assert store.entered.wait(10.0) and node_of(service, X).store_op is not None
    service.evict(10**6)  # host-only while its put is in flight
    store.gate.set()
    puts_done(service, 2)
    node = node_of(service, X)
    assert node.in_storage and node.host is not None
    assert host_hit(service, X) == 4 and host_hit(service, X) == 4
    service.step()
    assert store.puts == 1, "stored once, matched twice since"
    service.check_integrity()


def test_selective_puts_a_node_once_at_its_hits_and_keeps_its_host_copy(build) -> None:
    service, store = build("write_through_selective", write_through_hits=2)
    put(service, Z)
    host_backups_done(service)
    assert store.puts == 0 and node_of(service, Z).store_op is None, "no hit yet"
    service.match(service.key(Z))
    service.match(service.key(Z))  # the second hit queues the put
    assert store.entered.wait(10.0) and node_of(service, Z).store_op is not None
    service.match(service.key(Z))  # in flight: not put again
    service.evict(10**6)
    store.gate.set()
    puts_done(service, 2)
    node = node_of(service, Z)
    assert node.in_storage and node.host is not None
    assert host_hit(service, Z) == 4 and host_hit(service, Z) == 4  # stored: not put again
    service.step()
    assert store.puts == 1
    service.check_integrity()


def test_selective_lets_a_node_below_its_hits_leave_the_host_without_a_put(build) -> None:
    service, store = build("write_through_selective", write_through_hits=2)
    store.gate.set()
    put(service, Y)
    host_backups_done(service)
    service.evict(10**6)
    assert service.evict_host(10**6) == 4
    assert not list(service.tree.nodes())
    assert service.storage is not None and service.storage.stats.backup_evictions == 0
    service.step()
    assert store.puts == 0
    service.check_integrity()


def test_write_back_with_its_backup_queue_full_drops_the_put_and_evicts(
        build, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hicache.l3.tier.MAX_QUEUED_BACKUPS", 1)
    service, store = build("write_back")
    assert service.storage is not None
    stats = service.storage.stats
    put(service, X)
    host_backups_done(service)
    service.evict(10**6)
    assert service.evict_host(10**6) == 0  # X kept for the store: its put waits at the gate
    assert store.entered.wait(10.0)
    for tokens in (Y, Z):
        put(service, tokens)
    host_backups_done(service)
    service.evict(10**6)
    # Y's put fills the queue; Z's finds it full: dropped, and Z leaves as with no store
    assert service.evict_host(10**6) == 4
    assert stats.backup_pages["dropped"] == 2 and stats.backup_evictions == 0  # none stored
    assert sorted(n.tokens for n in service.tree.nodes()) == [tuple(X), tuple(Y)]
    assert node_of(service, Y).store_op is not None
    store.gate.set()
    puts_done(service, 4)
    assert not list(service.tree.nodes()), "X and Y left once stored"
    assert store.puts == 2 and stats.backup_pages["dropped"] == 2
    assert stats.backup_evictions == 2  # X and Y, written to the store and then evicted
    service.check_integrity()


def test_selective_puts_a_node_whose_hits_came_before_its_host_copy(build) -> None:
    """Matched twice before its host copy was acknowledged: the put goes at the ack."""
    service, store = build("write_through_selective", write_through_hits=2)
    store.gate.set()
    put(service, Z)
    service.match(service.key(Z))
    service.match(service.key(Z))
    assert node_of(service, Z).host is None or node_of(service, Z).write_op is not None
    host_backups_done(service)
    puts_done(service, 2)
    assert node_of(service, Z).in_storage and store.puts == 1
    service.check_integrity()
