"""Prefetches against a full worker queue, and an early finish that stops the worker's
reads: a prefetch refused at its query leaves no lock and counts its tail ``queue_full``; a
load refused after the store answered gives back its host slots and counts the found pages
``queue_full``; a prefetch finished while its pages are being read stops the worker after
the batch it is on; an integrity check while a hybrid prefetch's read waits counts the full
and SWA host slots it holds (CPU, the real file store behind a gate that holds the chosen
calls)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gated_store import GatedFileStore, gated_service
from test_l3_tier import MODEL, make_config, put, settle

from hicache.factory import build_service
from hicache.l3.jobs import PrefetchPhase
from hicache.l3.prefetches import BATCH_PAGES
from hicache.service import HiCacheService

X = list(range(500, 508))  # 4 pages of 2: in the store
Y = list(range(600, 608))  # in the store
Z = list(range(700, 708))  # not in the store
LONG = list(range(800, 800 + 2 * (BATCH_PAGES + 4)))  # two batches of reads


def store_of(tmp_path: Path, device_tokens: int, *requests: list[int]) -> None:
    """Store each of ``requests`` (a prefix of its own: pages are hashed with their
    prefix)."""
    writer = build_service(make_config(tmp_path / "l3", device_tokens=device_tokens), **MODEL)
    try:
        for tokens in requests:
            put(writer, tokens)
        settle(writer)
    finally:
        writer.stop()


@pytest.fixture
def one_queued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
               ) -> Iterator[tuple[HiCacheService, GatedFileStore]]:
    """A reader whose prefetch worker queues one job at most, of a store that has ``X`` and
    ``Y``; its queries (``exists``) wait at the gate, which starts open."""
    store_of(tmp_path, 32, X, Y)
    monkeypatch.setattr("hicache.l3.tier.MAX_QUEUED_PREFETCHES", 1)
    reader, store = gated_service(monkeypatch, make_config(tmp_path / "l3"), MODEL,
                                  gated=("exists",))
    store.gate.set()
    try:
        yield reader, store
    finally:
        store.gate.set()
        reader.stop()


def hold_the_worker(service: HiCacheService, store: GatedFileStore) -> None:
    """Close the gate, hold the worker in a query of ``Z`` and fill the queue with one of
    ``Y``."""
    store.gate.clear()
    store.entered.clear()
    held = service.prefetch(service.key(Z), service.match(service.key(Z)))
    assert held is not None and store.entered.wait(10.0)
    queued = service.prefetch(service.key(Y), service.match(service.key(Y)))
    assert queued is not None


def test_wait_prefetch_times_out_while_the_store_holds_the_query_and_waits_unbounded(
        one_queued: tuple[HiCacheService, GatedFileStore]) -> None:
    """``wait_prefetch`` answers ``False`` once its timeout passes with the prefetch not
    ready (the store holds its query), after waiting that long and not much more (a timeout
    of 0 answers at once); without a timeout it waits, slice after slice, until the
    prefetch is ready (``wait_complete``: every page read)."""
    reader, store = one_queued
    store.gate.clear()
    store.entered.clear()
    prefetch = reader.prefetch(reader.key(X), reader.match(reader.key(X)))
    assert prefetch is not None and store.entered.wait(10.0)
    start = time.monotonic()
    assert reader.wait_prefetch(prefetch, timeout_s=0.3) is False
    assert 0.3 <= time.monotonic() - start < 5.0
    assert reader.wait_prefetch(prefetch, timeout_s=0.0) is False
    assert not reader.prefetch_ready(prefetch)
    opener = threading.Timer(0.3, store.gate.set)  # opens while the next wait runs
    opener.start()
    try:
        assert reader.wait_prefetch(prefetch) is True
    finally:
        opener.join()
    assert reader.finish_prefetch(prefetch) == len(X)
    reader.check_integrity()


def test_a_prefetch_refused_by_a_full_queue_counts_its_tail_and_locks_nothing(one_queued
                                                                             ) -> None:
    reader, store = one_queued
    put(reader, X[:2])  # the refused prefetch's match ends in this node
    settle(reader)
    node = reader.match(reader.key(X)).last_host_node
    assert node is not reader.tree.root and node.lock_count == 0
    hold_the_worker(reader, store)
    tier = reader.storage
    assert tier is not None
    started = tier.stats.prefetches
    assert reader.prefetch(reader.key(X), reader.match(reader.key(X))) is None
    assert tier.stats.prefetch_tokens["queue_full"] == len(X) - 2
    assert tier.stats.prefetches == started and node.lock_count == 0
    assert len(tier.prefetches.open_prefetches()) == 2
    store.gate.set()
    for prefetch in tier.prefetches.open_prefetches():
        assert reader.wait_prefetch(prefetch, timeout_s=10.0)
        reader.finish_prefetch(prefetch)
    reader.check_integrity()


def test_a_load_refused_by_a_full_queue_frees_its_slots_and_counts_the_found_pages(
        one_queued) -> None:
    reader, store = one_queued
    tier = reader.storage
    assert tier is not None
    free = reader.controller.host_pool.allocator.num_free_tokens
    answered = reader.prefetch(reader.key(X), reader.match(reader.key(X)))
    assert answered is not None
    assert answered.job.changed.wait(10.0) and answered.job.done  # answered, not applied
    hold_the_worker(reader, store)
    assert reader.prefetch_ready(answered)  # applies the answer: its load is refused
    assert answered.job.phase is PrefetchPhase.DONE and answered.job.unread == "queue_full"
    assert answered.job.host is None
    assert reader.controller.host_pool.allocator.num_free_tokens == free
    assert reader.finish_prefetch(answered) == 0
    assert tier.stats.prefetch_tokens["queue_full"] == len(X)
    assert tier.stats.found_tokens == len(X)
    assert reader.match(reader.key(X)).host_hit_tokens == 0
    store.gate.set()
    for prefetch in tier.prefetches.open_prefetches():
        assert reader.wait_prefetch(prefetch, timeout_s=10.0)
        reader.finish_prefetch(prefetch)
    reader.check_integrity()
    assert reader.controller.host_pool.allocator.num_free_tokens == free - len(Y)


def test_a_prefetch_finished_during_its_reads_stops_the_worker_after_that_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store_of(tmp_path, 64, LONG)
    config = make_config(tmp_path / "l3", prefetch="best_effort", device_tokens=64)
    reader, store = gated_service(monkeypatch, config, MODEL, gated=("get",))
    try:
        tier = reader.storage
        assert tier is not None
        free = reader.controller.host_pool.allocator.num_free_tokens
        prefetch = reader.prefetch(reader.key(LONG), reader.match(reader.key(LONG)))
        assert prefetch is not None
        deadline = time.monotonic() + 10.0
        while prefetch.job.phase is not PrefetchPhase.LOAD:  # until the answer is applied
            assert prefetch.job.phase is not PrefetchPhase.DONE
            assert time.monotonic() < deadline, "the store never answered"
            assert reader.prefetch_ready(prefetch)  # best effort: always ready; polls
            time.sleep(0.001)
        assert store.entered.wait(10.0)  # the first batch's read waits at the gate
        assert reader.finish_prefetch(prefetch) == 0  # nothing has arrived yet
        store.gate.set()
        tier.prefetch_worker.close()  # runs what is queued, then stops
        assert store.calls["get"] == 1, "the worker read on after the prefetch was finished"
        tier.poll()  # the job is back: the slots the early finish left behind are freed
        assert not tier.prefetches.held_slots()
        assert reader.controller.host_pool.allocator.num_free_tokens == free
        assert tier.stats.prefetch_tokens["used"] == 0
        reader.check_integrity()
    finally:
        store.gate.set()
        reader.stop()


def test_an_integrity_check_counts_what_a_hybrid_prefetch_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a hybrid prefetch's read waits at the gate, its full and SWA host slots are
    held outside the tree; the check counts both as held (no leak) and so does it after."""
    writer = build_service(make_config(tmp_path / "l3", hybrid=True), **MODEL)
    try:
        put(writer, X)
        settle(writer)
    finally:
        writer.stop()
    config = make_config(tmp_path / "l3", hybrid=True)
    reader, store = gated_service(monkeypatch, config, MODEL, gated=("get",))
    try:
        tier = reader.storage
        assert tier is not None
        prefetch = reader.prefetch(reader.key(X), reader.match(reader.key(X)))
        assert prefetch is not None
        deadline = time.monotonic() + 10.0
        while not store.entered.is_set():  # the answer applied: the read holds its slots
            assert time.monotonic() < deadline, "the read never started"
            reader.prefetch_ready(prefetch)
            time.sleep(0.001)
        held = tier.held_host_swa_slots()
        assert held is not None and len(held) == len(X)
        reader.check_integrity()
        store.gate.set()
        assert reader.wait_prefetch(prefetch, timeout_s=10.0)
        assert reader.finish_prefetch(prefetch) == len(X)
        reader.check_integrity()
    finally:
        store.gate.set()
        reader.stop()
