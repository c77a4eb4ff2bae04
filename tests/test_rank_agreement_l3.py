"""Tensor-parallel ranks with a shared store (:mod:`hicache.l3.held_jobs`): real spawned
processes, a real gloo group, a real file store per rank (each its own namespace in one
directory). What the ranks' stores answer differs (pages one rank's store lost, each rank's
own timing), and the ranks' answers must not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from rank_helpers import make_config, run_ranks
from rank_store_helpers import MODEL, lost_pages, store_config, store_traffic

from hicache.factory import build_service
from hicache.l3.jobs import PrefetchPhase
from hicache.rank_agreement import RanksDivergedError


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("agreed", [False, True], ids=["alone", "agreed"])
def test_a_page_one_ranks_store_lost_is_lost_to_every_rank(tmp_path: Path, agreed: bool
                                                           ) -> None:
    """Rank 1's store lost the last 4 of a prompt's 8 pages. Services of their own part
    ways: rank 0 gets 16 tokens back, rank 1 gets 8. With the group both find, read and
    cache the 8 that every rank's store has. With the group, each rank's pages are named by
    its rank in the group (the arguments left out)."""
    results = run_ranks(lost_pages, 2, tmp_path, agreed, str(tmp_path / "l3"))
    if not agreed:
        assert [r["host_hit"] for r in results] == [16, 8]
        return
    for result in results:
        assert (result["found"], result["attached"], result["host_hit"]) == (8, 8, 8)
    assert [r["namespace_rank"] for r in results] == [0, 1]


CASES = {
    "wait_complete": {},
    "best_effort": {"prefetch_policy": "best_effort"},
    "timeout": {"prefetch_policy": "timeout", "timeout_s": 0.01},
    "store_write_back": {"write_policy": "write_back"},
    "selective": {"write_policy": "write_through_selective"},
    "host_write_back": {"policy": "write_back"},
    "hybrid": {"hybrid": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_with_stores_of_their_own_give_the_same_answers(tmp_path: Path, case: str
                                                              ) -> None:
    """Two ranks serve the same 120 requests, each prefetched from the rank's store first,
    with their background threads running, different sleeps, and each rank's store
    losing pages of its own choosing: request by request the ranks find, read, cache, hit
    and load the same tokens, the check of every step finds their pools alike, every held
    job is applied by ``stop``, and the store was used (pages stored, prefetches made)."""
    results = run_ranks(store_traffic, 2, tmp_path, str(tmp_path / "l3"), CASES[case], 7,
                        120)
    for result in results:
        assert result["diverged"] is None and result["held"] == 0
        assert result["stored"] > 0 and result["prefetches"] > 0 and result["dropped"] == 0
    assert results[0]["answers"] == results[1]["answers"]
    # best_effort finishes at once (nothing has arrived yet), timeout when it may
    if case not in ("best_effort", "timeout"):
        assert any(answer[1] > 0 for answer in results[0]["answers"])


def test_three_ranks_agree_too(tmp_path: Path) -> None:
    results = run_ranks(store_traffic, 3, tmp_path, str(tmp_path / "l3"), {}, 11, 80)
    assert all(r["diverged"] is None and r["held"] == 0 for r in results)
    assert results[0]["answers"] == results[1]["answers"] == results[2]["answers"]


def test_a_rank_that_made_a_call_the_others_did_not_fails_every_rank_at_its_step(
        tmp_path: Path) -> None:
    """Rank 1 allocates device slots that rank 0 does not: the next step raises
    :class:`RanksDivergedError` on both ranks, naming what differs, instead of their models'
    collectives hanging later on."""
    results = run_ranks(_extra_call, 2, tmp_path, str(tmp_path / "l3"))
    for result in results:
        assert result["error"] is not None
        assert "free device tokens 28 to 32" in result["error"]
        assert "same service calls" in result["error"]


def _extra_call(rank: int, path: str) -> dict[str, Any]:
    group = dist.new_group(backend="gloo")
    service = build_service(store_config(path), tp_group=group, **MODEL)
    error = None
    try:
        service.step()  # alike so far
        if rank == 1:
            assert service.alloc_device(4) is not None
        service.step()
    except RanksDivergedError as exc:
        error = str(exc)
    finally:
        service.stop()
    return {"error": error}


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
        prefetches = [service.prefetch(tokens, service.match(tokens))
                      for tokens in ([40, 1, 2, 3], [50, 1, 2, 3])]
        for prefetch in prefetches:
            assert prefetch is not None and prefetch.job.changed.wait(5.0)
        assert storage.prefetch_worker.depth == 0  # the worker is idle, yet:
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
