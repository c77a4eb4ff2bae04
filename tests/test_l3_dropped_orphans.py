"""A never-backed-up device node dropped by eviction takes the host-only nodes below it
along; where one of those is still being put to the store, its host slots stay held until
the put is back (the put reads them), then are freed (CPU, the real file store in a
temporary directory, its puts held at a gate)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from gated_store import gated_service
from test_l3_tier import MODEL, make_config, put

from hicache.config import WritePolicy
from hicache.radix.node import TreeNode
from hicache.service import HiCacheService


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A service whose host holds one page (of 2 tokens), backing up after one hit, over a
    gated file store; yields (service, store)."""
    config = make_config(tmp_path / "l3")
    config = dataclasses.replace(
        config, host=dataclasses.replace(config.host, ratio=1 / 16),
        controller=dataclasses.replace(config.controller,
                                       write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE,
                                       write_through_hits=1))
    service, store = gated_service(monkeypatch, config, MODEL)
    yield service, store
    store.gate.set()
    service.stop()


def wait_stored(service: HiCacheService, pages: int, timeout_s: float = 10.0) -> None:
    assert service.storage is not None
    deadline = time.monotonic() + timeout_s
    while service.storage.stats.backup_pages["stored"] < pages:
        assert time.monotonic() < deadline, "the put did not come back"
        time.sleep(0.002)
        service.step()


PARENT, LONGER = [1, 1, 2, 2], [1, 1, 2, 2, 3, 3]


def parent_on_device_child_on_host(service: HiCacheService) -> TreeNode:
    """Cache ``PARENT`` and ``LONGER`` and hit them once: the parent (4 tokens) finds no
    room on the host, the child (2 tokens) is backed up and queued for the store; returns
    the child."""
    put(service, PARENT)
    put(service, LONGER)
    service.match(service.key(LONGER))  # the hit that makes both worth a backup
    for _ in range(50):
        service.step()
        if service.controller.num_in_flight == 0:
            break
    assert service.tree.stats.refused_backups["host_full"] == 4
    by_size = {node.num_tokens: node for node in service.tree.nodes()}
    assert by_size[4].host is None and by_size[2].host is not None
    assert service.tree.io.host_free_tokens() == 0
    return by_size[2]


def test_an_orphan_being_put_keeps_its_host_slots_until_the_put_is_back(gated) -> None:
    service, store = gated
    io = service.tree.io
    host_tokens = io.host_free_tokens()
    assert host_tokens == 2
    child = parent_on_device_child_on_host(service)
    assert child.store_op is not None, "its put waits at the gate"

    assert service.evict(10**6) == 6
    assert service.tree.stats.dropped_tokens == {"no_backup": 4, "orphaned": 2}
    assert not list(service.tree.nodes())
    assert io.host_free_tokens() == 0, "the put still reads the orphan's host slots"
    service.check_integrity()

    store.gate.set()
    wait_stored(service, 1)
    assert io.host_free_tokens() == host_tokens, "freed once the put is back"
    service.check_integrity()


def test_an_orphan_already_stored_frees_its_host_slots_at_once(gated) -> None:
    service, store = gated
    io = service.tree.io
    store.gate.set()
    child = parent_on_device_child_on_host(service)
    wait_stored(service, 1)
    assert child.store_op is None and child.in_storage
    assert service.evict(10**6) == 6
    assert service.tree.stats.dropped_tokens == {"no_backup": 4, "orphaned": 2}
    assert io.host_free_tokens() == 2
    service.check_integrity()
