"""Counters of the shared store's tier that an audit of failures found wrong:

- under ``write_back`` with a store failing every put, host eviction counted the nodes it
  sent to the store as written back (``hicache_l3_written_back_nodes_total``, "host nodes
  written to the store before their host copy was evicted") though nothing was written;
- ``finish_prefetch`` during a read took the job's statuses twice while the worker extended
  them, so the pages landing in between were counted in no outcome (every prefetched token
  must end in exactly one).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
from gated_store import gated_service
from test_l3_stress import build, l3_config, quiesce, tier_of
from test_l3_stress import put as put_stress
from test_l3_stress_faults import namespace_dir
from test_l3_tier import MODEL, make_config, put, settle

from hicache.factory import build_service


def test_written_back_nodes_counts_only_nodes_the_store_stored(tmp_path: Path) -> None:
    service = build(l3_config(tmp_path / "l3", policy="write_back", interval_s=60.0),
                    tmp_path.name)
    try:
        directory = namespace_dir(tmp_path / "l3")
        shutil.rmtree(directory)
        directory.write_bytes(b"")  # every put fails: "Not a directory"
        put_stress(service, list(range(100, 108)))
        quiesce(service)
        service.evict(10**6)
        service.evict_host(10**6)  # the leaf is sent to the store first (write_back)
        quiesce(service)
        stats = tier_of(service).stats
        assert stats.backup_pages["stored"] == 0 and stats.backup_pages["failed"] == 4
        assert not list(service.tree.nodes())  # the host copy left anyway
        # nothing was written back, so the counter of nodes written back must not move
        assert stats.backup_evictions == 0, (
            f"backup_evictions={stats.backup_evictions} with 0 pages stored")
        service.check_integrity()
    finally:
        service.stop()


TOKENS = list(range(500, 520))  # 10 pages of 2


class RacyStatuses(list):
    """The job's status list: the moment the scheduler has taken its slice, the worker runs
    (its held read returns and extends this list) before the scheduler goes on."""

    gate: threading.Event

    def __getitem__(self, index):  # type: ignore[override]
        result = super().__getitem__(index)
        if isinstance(index, slice):
            before = len(self)
            self.gate.set()  # the worker's held get returns
            deadline = time.monotonic() + 10
            while len(self) == before and time.monotonic() < deadline:
                time.sleep(0.001)
        return result


def test_every_prefetched_token_is_counted_once_when_finished_mid_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = build_service(make_config(tmp_path / "l3"), **MODEL)
    put(writer, TOKENS)
    settle(writer)
    writer.stop()
    monkeypatch.setattr("hicache.l3.prefetches.BATCH_PAGES", 2)
    service, store = gated_service(monkeypatch, make_config(tmp_path / "l3",
                                   prefetch="best_effort"), MODEL, gated=("get",), passed=1)
    try:
        key = service.key(TOKENS)
        prefetch = service.prefetch(key, service.match(key))
        assert prefetch is not None
        deadline = time.monotonic() + 10
        while not store.entered.is_set():  # the query answered, the first batch read
            service.step()
            assert time.monotonic() < deadline
            time.sleep(0.002)
        job = prefetch.job
        racy = RacyStatuses(job.statuses)
        racy.gate = store.gate
        job.statuses = racy
        service.finish_prefetch(prefetch)
        for _ in range(50):
            service.step()
            time.sleep(0.002)
        stats = service.storage.stats
        assert stats.queried_tokens == len(TOKENS)
        assert sum(stats.prefetch_tokens.values()) == stats.queried_tokens, \
            dict(stats.prefetch_tokens)
        service.check_integrity()
    finally:
        store.gate.set()
        service.stop()
