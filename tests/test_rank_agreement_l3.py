"""Tensor-parallel ranks with a shared store (:mod:`hicache.l3.held_jobs`): real spawned
processes, a real gloo group, a real file store per rank (each its own namespace in one
directory). What the ranks' stores answer differs (pages one rank's store lost, each rank's
own timing), and the ranks' answers must not."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from rank_helpers import run_ranks
from rank_store_helpers import MODEL, lost_pages, store_config, store_traffic
from storage_helpers import needs_redis

from hicache.bench.redis_local import RedisServer
from hicache.factory import build_service
from hicache.rank_agreement import RanksDivergedError


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
        assert "free device tokens by rank: 32, 28" in result["error"]
        assert "same service calls" in result["error"]


def test_a_prefetch_on_one_rank_only_fails_every_rank_at_its_step(tmp_path: Path) -> None:
    """Rank 1 asks its store for a prompt that rank 0 does not: the next step names the
    store jobs and open prefetches each rank has."""
    results = run_ranks(_extra_call, 2, tmp_path, str(tmp_path / "l3"), "prefetch")
    for result in results:
        assert "store prefetch jobs held by rank: 0, 1" in result["error"]
        assert "open prefetches by rank: 0, 1" in result["error"]


def test_a_step_that_raises_on_one_rank_raises_on_every_rank_at_that_step(
        tmp_path: Path) -> None:
    """Rank 1's step finds its device's bounds check tripped (the check made to raise
    there): no rank waits for it, none goes on a step ahead; every rank raises
    :class:`RanksDivergedError` at that step, rank 1's caused by its own error."""
    results = run_ranks(_extra_call, 2, tmp_path, str(tmp_path / "l3"), "raise")
    for rank, result in enumerate(results):
        assert "the step raised on a tensor-parallel rank" in result["error"]
        assert "steps that raised by rank: 0, 1" in result["error"]
        assert result["steps"] == 1
        assert result["cause"] == ("RuntimeError: out-of-bounds slot (injected)" if rank
                                   else None)


def test_a_step_that_raises_on_every_rank_raises_each_ranks_own_error(tmp_path: Path
                                                                      ) -> None:
    """Every rank's bounds check trips at the same step (the same bad slot in every rank's
    forward): each raises its own error, as a service of its own would, and the group
    goes on alike: the next step agrees and applies what that one held."""
    results = run_ranks(_raise_on_every_rank, 2, tmp_path, str(tmp_path / "l3"))
    for result in results:
        assert result["raised"] == "RuntimeError: out-of-bounds slot (injected)"
        assert result["after_raise"] == [1, False]  # the put agreed back, not applied
        assert result["after_next"] == [0, True]


def _raise_on_every_rank(rank: int, path: str) -> dict[str, Any]:
    group = dist.new_group(backend="gloo")
    service = build_service(store_config(path), tp_group=group, **MODEL)
    storage = service.storage
    assert storage is not None and storage.held is not None
    tokens = [1, 2, 3, 4]

    def state() -> list[Any]:
        [node] = [n for n in service.tree.nodes() if n.tokens == tuple(tokens)]
        return [storage.held.num_held, node.in_storage]  # type: ignore[union-attr]

    try:
        slots = service.alloc_device(4)
        assert slots is not None
        service.insert(tokens, slots)
        service.step()  # the host backup, acknowledged at once on a CPU: its put queued
        while not storage.held.puts[0].done:  # the put is back on this rank
            time.sleep(0.001)
        dist.barrier()  # and on the other
        service.controller.raise_if_tripped = _tripped  # type: ignore[method-assign]
        try:
            service.step()  # agrees that the put is back, then raises
        except RuntimeError as exc:
            raised = f"{type(exc).__name__}: {exc}"
        del service.controller.raise_if_tripped
        after_raise = state()
        service.step()
        after_next = state()
    finally:
        service.stop()
    return {"raised": raised, "after_raise": after_raise, "after_next": after_next}


def _extra_call(rank: int, path: str, call: str = "alloc_device") -> dict[str, Any]:
    group = dist.new_group(backend="gloo")
    service = build_service(store_config(path), tp_group=group, **MODEL)
    error = cause = None
    steps = 0
    try:
        service.step()  # alike so far
        steps += 1
        if rank == 1 and call == "alloc_device":
            assert service.alloc_device(4) is not None
        if rank == 1 and call == "prefetch":
            tokens = [5, 6, 7, 8]
            assert service.prefetch(tokens, service.match(tokens)) is not None
        if rank == 1 and call == "raise":
            service.controller.raise_if_tripped = _tripped  # type: ignore[method-assign]
        service.step()
        steps += 1
    except RanksDivergedError as exc:
        error = str(exc)
        if exc.__cause__ is not None:
            cause = f"{type(exc.__cause__).__name__}: {exc.__cause__}"
    finally:
        if call == "raise" and rank == 1:
            del service.controller.raise_if_tripped  # the class's again, for stop
        service.stop()
    return {"error": error, "cause": cause, "steps": steps}


@needs_redis
def test_ranks_whose_stores_die_apart_give_the_same_answers(tmp_path: Path) -> None:
    """Each rank has a Redis server of its own; rank 1 kills its own (SIGKILL) after 40 of
    120 requests, while rank 0's keeps answering. The ranks still answer alike: what rank
    1's dead store cannot find, rank 0's is not used for either, and a put that failed on
    rank 1 stores its node on no rank."""
    servers = []
    try:
        for rank in range(2):
            (tmp_path / f"redis{rank}").mkdir()
            servers.append(RedisServer(tmp_path / f"redis{rank}").start())
        process = servers[1].process
        assert process is not None
        urls = [f"redis://127.0.0.1:{server.port}" for server in servers]
        first, second = run_ranks(store_traffic, 2, tmp_path, urls, {}, 3, 120,
                                  (40, process.pid))
    finally:
        for server in servers:
            server.stop()
    for result in (first, second):
        assert result["diverged"] is None and result["held"] == 0 and result["stored"] > 0
    assert first["failed"] == 0 and second["failed"] > 0
    assert first["answers"] == second["answers"]
    assert any(answer[1] > 0 for answer in first["answers"][:40])  # the stores were used


def _tripped() -> None:
    raise RuntimeError("out-of-bounds slot (injected)")
