"""A tensor-parallel rank's store jobs, step by step (:mod:`hicache.l3.held_jobs`), in a
group of one (a real gloo group, which agrees with itself): what a step agrees on and when,
the held jobs' limits, the ``timeout`` policy's agreed deadline, and ``stop``. Real file
stores; a gate holds a store call in flight where the test needs one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from gated_store import gated_service
from rank_helpers import make_config
from rank_store_helpers import MODEL, store_config

from hicache.factory import build_service
from hicache.l3.jobs import PrefetchPhase
from hicache.metrics import MetricsExporter
from hicache.storage import chain_page_hashes


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()



def test_a_ranks_prefetch_changes_only_at_its_steps(one_rank_group: Any, tmp_path: Path
                                                    ) -> None:
    """On a rank, the store's answer reaches the prefetch only at a step (a group of one
    agrees with itself): until then nothing was found, the policy does not say ready, and
    the job is held; ``wait_prefetch`` steps until ready and refuses a timeout, which each
    rank's clock would end at a different step."""
    service = build_service(store_config(str(tmp_path / "l3")), tp_group=one_rank_group,
                            **MODEL)
    storage = service.storage
    assert storage is not None and storage.held is not None
    tokens = list(range(40, 56))
    try:
        slots = service.alloc_device(16)
        assert slots is not None
        service.insert(tokens, slots)
        service.step()
        for _ in range(500):
            if storage.stats.backup_pages["stored"] == 8:
                break
            service.step()
        assert storage.stats.backup_pages["stored"] == 8
        assert service.match(tokens).last_device_node.in_storage  # the agreed put's result
        assert service.evict(16) == 16 and service.evict_host(16) == 16
        prefetch = service.prefetch(tokens, service.match(tokens))
        assert prefetch is not None
        assert storage.held.prefetch_jobs == [prefetch.job]
        prefetch.job.changed.wait(5.0)  # the store answered on this rank
        assert prefetch.job.phase is not PrefetchPhase.QUERY
        assert prefetch.found_tokens is None and not service.prefetch_ready(prefetch)
        with pytest.raises(ValueError, match="timeout_s on a tensor-parallel rank"):
            service.wait_prefetch(prefetch, timeout_s=1.0)
        assert service.wait_prefetch(prefetch)
        assert prefetch.found_tokens == 16 and storage.held.num_held == 0
        assert service.finish_prefetch(prefetch) == 16
        assert service.match(tokens).host_hit_tokens == 16
    finally:
        service.stop()
    service.check_integrity()


def test_a_ranks_store_queues_are_full_by_the_jobs_held_not_by_the_workers_depth(
        one_rank_group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for two jobs a queue: the third put of a step is dropped and the third
    prefetch refused (``queue_full``) although the worker finished the first two, whose
    results the ranks have not agreed on yet (the worker's own depth is each rank's timing;
    the jobs held are a count every rank has). Once a step agreed on them, there is room."""
    monkeypatch.setattr("hicache.l3.tier.MAX_QUEUED_BACKUPS", 2)
    monkeypatch.setattr("hicache.l3.tier.MAX_QUEUED_PREFETCHES", 2)
    service = build_service(store_config(str(tmp_path / "l3")), tp_group=one_rank_group,
                            **MODEL)
    storage = service.storage
    assert storage is not None and storage.held is not None
    stats = storage.stats
    try:
        for first in (10, 20, 30):  # three nodes, backed up as one op, put one each
            slots = service.alloc_device(4)
            assert slots is not None
            service.insert([first, 1, 2, 3], slots)
        service.step()  # the host backup's ack queues the puts: two held, one dropped
        assert len(storage.held.puts) == 2 and stats.backup_pages["dropped"] == 2
        assert service.stats.rank_held_ops == {"write": 0, "load": 0, "put": 2, "prefetch": 0}
        exported = MetricsExporter(service.controller.stats, service=service.stats).render()
        assert b'hicache_tp_held_ops{kind="put"} 2.0' in exported
        assert b"hicache_tp_agreements_total 1.0" in exported
        prefetches = [service.prefetch(tokens, service.match(tokens))
                      for tokens in ([40, 1, 2, 3], [50, 1, 2, 3])]
        for prefetch in prefetches:
            assert prefetch is not None and prefetch.job.changed.wait(5.0)
        assert storage.prefetch_worker.depth == 0 and storage.held.num_held == 4
        # the worker is idle, yet:
        assert service.prefetch([60, 1, 2, 3], service.match([60, 1, 2, 3])) is None
        assert stats.prefetch_tokens["queue_full"] == 4
        for prefetch in prefetches:
            assert prefetch is not None and service.wait_prefetch(prefetch)
            service.finish_prefetch(prefetch)
        assert service.prefetch([60, 1, 2, 3], service.match([60, 1, 2, 3])) is not None
    finally:
        service.stop()
    assert stats.backup_pages["stored"] == 4


def test_a_ranks_busy_event_set_is_waited_for_not_refused(one_rank_group: Any) -> None:
    """On a rank, ``start_loading`` waits for a busy event set instead of raising (whether
    it is still busy is each rank's timing); a service of its own raises. The wait itself
    is shown on a GPU (``test_events_gpu.py``)."""
    ranked = build_service(make_config("write_through"), tp_group=one_rank_group)
    single = build_service(make_config("write_through"))
    try:
        assert ranked.controller.layer_events.wait_when_busy
        assert not single.controller.layer_events.wait_when_busy
    finally:
        ranked.stop()
        single.stop()


def _cache_and_store(service: Any, sequences: list[list[int]]) -> None:
    """Cache ``sequences`` and step until the store has all their pages."""
    storage = service.storage
    for tokens in sequences:
        slots = service.alloc_device(len(tokens))
        assert slots is not None
        service.insert(tokens, slots)
    pages = sum(len(tokens) for tokens in sequences) // 2 + storage.stats.backup_pages["stored"]
    for _ in range(1000):
        service.step()
        if storage.stats.backup_pages["stored"] >= pages:
            return
        time.sleep(0.001)
    raise AssertionError("the puts never finished")


def _prefetch_from_store(service: Any, tokens: list[int]) -> Any:
    """Cache ``tokens``, wait for the store to have them, evict them from device and host,
    start their prefetch and wait for this rank's store to answer it (not yet agreed)."""
    _cache_and_store(service, [tokens])
    assert service.evict(len(tokens)) == len(tokens)
    assert service.evict_host(len(tokens)) == len(tokens)
    prefetch = service.prefetch(tokens, service.match(tokens))
    assert prefetch is not None and prefetch.job.changed.wait(5.0)
    return prefetch


def test_a_steps_agreement_reads_each_jobs_values(one_rank_group: Any, tmp_path: Path
                                                  ) -> None:
    """One step agrees on a put and two queries at once (the store has all 4 pages of A and
    2 of B's 4): each gets its own value, in order (A found 8 tokens, B 4, the put stored its
    node)."""
    service = build_service(store_config(str(tmp_path / "l3")), tp_group=one_rank_group,
                            **MODEL)
    storage = service.storage
    assert storage is not None and storage.held is not None
    a, b, c = [1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4, 3, 2], [5, 5, 5, 5, 6, 6, 6, 6]
    try:
        _cache_and_store(service, [a, b])
        storage.store.delete(chain_page_hashes(b, 2)[2:])
        assert service.evict(16) == 16 and service.evict_host(16) == 16
        slots = service.alloc_device(8)
        assert slots is not None
        service.insert(c, slots)
        service.step()  # C's host backup, acknowledged: its put is queued
        (put,) = storage.held.puts
        first = service.prefetch(a, service.match(a))
        second = service.prefetch(b, service.match(b))
        assert first is not None and second is not None
        for job in (first.job, second.job):
            assert job.changed.wait(5.0)
        for _ in range(500):
            if put.done:
                break
            time.sleep(0.002)
        assert put.done and first.found_tokens is None and second.found_tokens is None
        service.step()
        assert (first.found_tokens, second.found_tokens) == (8, 4)
        assert service.match(c).last_device_node.in_storage
        assert service.wait_prefetch(first) and service.wait_prefetch(second)
        assert (service.finish_prefetch(first), service.finish_prefetch(second)) == (8, 4)
    finally:
        service.stop()
    service.check_integrity()


def test_a_ranks_timeout_prefetch_is_ready_once_the_ranks_agree_its_deadline_passed(
        one_rank_group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``timeout`` policy, the store's reads held at a gate: past its deadline the prefetch
    is not ready until a step agreed that every rank's deadline passed; then it finishes
    with what arrived (nothing)."""
    # a deadline the query and a step meet even on a loaded machine
    config = store_config(str(tmp_path / "l3"), prefetch_policy="timeout", timeout_s=0.5)
    service, store = gated_service(monkeypatch, config, MODEL, gated=("get",),
                                   tp_group=one_rank_group)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    try:
        prefetch = _prefetch_from_store(service, tokens)  # answered on this rank
        service.step()  # agreed: 4 pages found; the read starts and waits at the gate
        assert prefetch.found_tokens == 8 and store.entered.wait(5.0)
        time.sleep(0.55)  # past the deadline here
        assert not service.prefetch_ready(prefetch)
        service.step()
        assert service.prefetch_ready(prefetch) and prefetch.timed_out
        assert service.finish_prefetch(prefetch) == 0
    finally:
        store.gate.set()
        service.stop()
    service.check_integrity()


def test_a_rank_that_stops_with_prefetches_held_applies_them(one_rank_group: Any,
                                                             tmp_path: Path) -> None:
    """Stopping with two prefetches the ranks never agreed on: ``stop`` applies them with
    the rank's own results (every job is back), finishes them, frees their host slots and
    counts every token asked about."""
    service = build_service(store_config(str(tmp_path / "l3")), tp_group=one_rank_group,
                            **MODEL)
    storage = service.storage
    assert storage is not None and storage.held is not None
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [2, 2, 3, 3, 4, 4]
    _cache_and_store(service, [a])
    assert service.evict(8) == 8 and service.evict_host(8) == 8
    for tokens in (a, b):
        assert service.prefetch(tokens, service.match(tokens)) is not None
    assert len(storage.held.prefetch_jobs) == 2
    service.stop()
    service.check_integrity()
    assert storage.held.num_held == 0 and not storage.prefetches.open_prefetches()
    assert sum(storage.stats.prefetch_tokens.values()) == storage.stats.queried_tokens == 14
    assert storage.stats.found_tokens == 8  # a's, as this rank's store answered


def test_a_best_effort_finish_during_a_read_uses_the_pages_every_rank_has_read(
        one_rank_group: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``best_effort``, a 20-page prefetch read in batches of 16: the second batch's read
    waits at a gate. A step agrees that 16 pages arrived (the read still runs); a finish
    then attaches those 32 tokens, and the rest are freed once the read is back."""
    config = store_config(str(tmp_path / "l3"), prefetch_policy="best_effort",
                          device_tokens=64)
    service, store = gated_service(monkeypatch, config, MODEL, gated=("get",), passed=1,
                                   tp_group=one_rank_group)
    tokens = list(range(200, 240))
    try:
        prefetch = _prefetch_from_store(service, tokens)
        service.step()  # agreed: 20 pages found; the read starts
        assert store.entered.wait(5.0) and prefetch.job.arrived == 16
        assert not prefetch.job.agreed_arrived  # none agreed yet
        service.step()
        assert prefetch.job.agreed_arrived == 16 and service.prefetch_ready(prefetch)
        assert service.finish_prefetch(prefetch) == 32
        assert service.match(tokens).host_hit_tokens == 32
    finally:
        store.gate.set()
        service.stop()
    service.check_integrity()


def test_a_finish_leaves_unused_slots_held_until_every_rank_is_back(
        one_rank_group: Any, tmp_path: Path) -> None:
    """``best_effort`` finished after this rank's read is back but before a step agreed on
    it: no page counts as arrived (none agreed), and the prefetch's host slots stay held
    (another rank may still be reading into its own) until the next step frees them."""
    service = build_service(store_config(str(tmp_path / "l3"), prefetch_policy="best_effort"),
                            tp_group=one_rank_group, **MODEL)
    storage = service.storage
    assert storage is not None
    host = service.controller.host_pool.allocator
    tokens = [7, 7, 8, 8, 9, 9, 1, 1]
    try:
        prefetch = _prefetch_from_store(service, tokens)
        service.step()  # agreed: 4 pages found; their read starts
        assert prefetch.job.changed.wait(5.0) and prefetch.job.done  # back on this rank
        free = host.num_free_tokens
        assert service.finish_prefetch(prefetch) == 0
        assert host.num_free_tokens == free
        service.check_integrity()
        service.step()
        assert host.num_free_tokens == free + 8
    finally:
        service.stop()
    service.check_integrity()
