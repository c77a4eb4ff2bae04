"""A hybrid model's pages go to the shared store with their SWA rows or not at all: a node
whose host SWA copies the tree evicted on their own (as it does when the SWA host pool is
short) has nothing the store can take. Its put is skipped and counted once as
``no_swa_rows``; under ``write_back`` it leaves the host as if there were no store (CPU,
the real file store in a temporary directory)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gated_store import GatedFileStore, gated_service
from test_l3_put_policies import host_backups_done, node_of
from test_l3_tier import MODEL, make_config, put

from hicache.radix.window_tail import evict_host_swa
from hicache.service import HiCacheService

P = list(range(100, 108))  # 4 pages of 2


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    made: list[tuple[HiCacheService, GatedFileStore]] = []

    def make(policy: str, **storage: object) -> tuple[HiCacheService, GatedFileStore]:
        config = make_config(tmp_path / "l3", policy=policy, hybrid=True, **storage)
        made.append(gated_service(monkeypatch, config, MODEL))
        made[-1][1].gate.set()
        return made[-1]

    yield make
    for service, _ in made:
        service.stop()


def without_host_swa(service: HiCacheService) -> None:
    """Cache ``P``, back it up to the host, then free its host SWA copies on their own."""
    put(service, P)
    host_backups_done(service)
    assert evict_host_swa(service.tree, len(P)) == len(P)
    host_swa = node_of(service, P).host_swa
    assert host_swa is not None and not host_swa.tensor.any()


def test_write_back_evicts_a_node_without_swa_rows_with_no_put(build) -> None:
    service, store = build("write_back")
    without_host_swa(service)
    service.evict(10**6)
    assert service.evict_host(10**6) == len(P)
    assert service.storage is not None
    stats = service.storage.stats
    assert stats.backup_pages["no_swa_rows"] == 4 and stats.backup_evictions == 0
    assert not list(service.tree.nodes())
    service.step()
    assert store.puts == 0
    service.check_integrity()


def test_selective_counts_a_node_without_swa_rows_once(build) -> None:
    service, store = build("write_through_selective", write_through_hits=2)
    without_host_swa(service)
    for _ in range(4):  # the second hit tries the put; the later ones do not again
        service.match(service.key(P))
    service.step()
    assert service.storage is not None
    assert service.storage.stats.backup_pages["no_swa_rows"] == 4
    assert store.puts == 0 and node_of(service, P).store_op is None
    service.check_integrity()
