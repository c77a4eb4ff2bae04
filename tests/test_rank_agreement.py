"""Tensor-parallel ranks, one service each, that apply finished transfers at the same step
(:mod:`hicache.rank_agreement`): real processes and a real gloo group.

On a CPU every transfer has finished when it is issued, so ranks that issue the same ops
agree on them at once; these tests hold the plumbing to its contract (exactly one collective
a step on every rank, every ack applied once, nothing held at stop, the same answers on
every rank with the background thread running beside each) and the refusals. Where ranks
really disagree, on a GPU whose copies finish at different times, is
``tests/test_rank_agreement_gpu.py``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from rank_helpers import make_config, random_traffic, run_ranks

from hicache.controller import Ack
from hicache.controller.base import Direction
from hicache.factory import build_service
from hicache.rank_agreement import RankAgreement


@pytest.mark.parametrize("policy,hybrid,seed", [
    ("write_through", False, 1), ("write_back", False, 2),
    ("write_through_selective", False, 3), ("write_through", True, 4),
])
def test_ranks_serving_the_same_requests_give_the_same_answers(
        tmp_path: Path, policy: str, hybrid: bool, seed: int) -> None:
    ranks = run_ranks(random_traffic, 2, tmp_path, policy, hybrid, seed, 150)
    first, second = ranks
    assert first["answers"] == second["answers"]
    for rank in ranks:
        assert rank["agreements"] == rank["steps"], "one collective a step, no other"
        assert rank["held"] == 0 and rank["engine_held_tokens"] == 0
        assert rank["acks_applied"] == first["acks_applied"] > 0
        assert rank["evicted_device_tokens"] == first["evicted_device_tokens"] > 0
    answers = first["answers"]
    assert any(answer[1] for answer in answers), "no host hit: the load direction is idle"
    assert any(answer[2] for answer in answers), "nothing was loaded back"


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Any:
    """This process as the only rank of a gloo group."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_group_is_refused_before_torch_distributed_is_initialised() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialised"):
        build_service(make_config("write_through"), tp_group=object())


def test_tp_arguments_other_than_the_groups_are_refused(one_rank_group: Any) -> None:
    with pytest.raises(ValueError, match=r"tp_size=2, tp_rank=1, but tp_group has 1 ranks"):
        build_service(make_config("write_through"), tp_group=one_rank_group, tp_size=2,
                      tp_rank=1)
    service = build_service(make_config("write_through"), tp_group=one_rank_group,
                            tp_size=1, tp_rank=0)  # the group's own: accepted
    service.stop()


def test_one_rank_applies_every_finished_op_at_its_step(one_rank_group: Any) -> None:
    """A group of one agrees with itself: each step applies what finished, holds nothing,
    and makes one collective; an allocation that evicts applies nothing itself."""
    service = build_service(make_config("write_through", device_tokens=8),
                            tp_group=one_rank_group)
    agreement = service._poller.agreement
    assert isinstance(agreement, RankAgreement) and (agreement.size, agreement.rank) == (1, 0)
    try:
        slots = service.alloc_device(8)
        assert slots is not None
        service.insert(list(range(8)), slots)
        # on a CPU the backup the step issues has finished when it polls: applied at once
        assert service.step() == 1 and agreement.agreements == 1 and agreement.num_held == 0
        assert service.step() == 0 and agreement.agreements == 2
        assert service.stats.rank_agreements == 2
        assert service.stats.rank_held_ops == dict.fromkeys(("write", "load", "put", "prefetch"), 0)
        assert service.match(list(range(8))).device_hit_tokens == 8
        again = service.alloc_device(8)  # evicts the backed-up node to the host
        assert again is not None and service.match(list(range(8))).host_hit_tokens == 8
        service.free_device(again)
        assert agreement.agreements == 2  # only steps make collectives
    finally:
        service.stop()
    service.check_integrity()


def test_a_write_back_eviction_frees_its_slots_at_the_next_step(one_rank_group: Any) -> None:
    """Under ``write_back`` an eviction writes the node back and its slots come free at the
    ack. A service of its own applies that ack inside the allocation that evicted; a rank
    holds it for the step, where every rank applies it, so the allocation finds no room."""
    alone = build_service(make_config("write_back", device_tokens=8))
    rank = build_service(make_config("write_back", device_tokens=8), tp_group=one_rank_group)
    agreement = rank._poller.agreement
    assert agreement is not None
    try:
        for service in (alone, rank):
            slots = service.alloc_device(8)
            assert slots is not None
            service.insert(list(range(8)), slots)
            service.step()
        assert alone.alloc_device(2) is not None  # written back and freed within the call
        assert rank.alloc_device(2) is None  # written back; its ack waits for the step
        assert rank.match(list(range(8))).device_hit_tokens == 8  # on the device still
        assert rank.step() == 1 and agreement.num_held == 0
        assert rank.match(list(range(8))).host_hit_tokens == 8
        got = rank.alloc_device(2)
        assert got is not None
        rank.free_device(got)
    finally:
        alone.stop()
        rank.stop()
    rank.check_integrity()


def test_the_background_thread_of_a_rank_issues_no_backup(one_rank_group: Any) -> None:
    """A quiet scheduler's backups wait for its step on a rank (the thread of a service of
    its own issues them): when a backup is issued must not depend on each rank's timing."""
    service = build_service(make_config("write_through"), tp_group=one_rank_group)
    service.start()
    try:
        slots = service.alloc_device(4)
        assert slots is not None
        service.insert([1, 2, 3, 4], slots)
        passes = service.stats.background_passes
        deadline = time.monotonic() + 60.0
        while service.stats.background_passes < passes + 5:  # the thread woke, and again
            assert time.monotonic() < deadline, "the background thread never woke"
            time.sleep(0.005)
        assert service.tree.has_queued_backups
        assert service.step() == 1 and not service.tree.has_queued_backups
    finally:
        service.stop()


def _ack(op_id: int, direction: Direction) -> Ack:
    return Ack(op_id, direction, [], {}, {}, None, "torch")


def test_held_acks_are_taken_a_direction_at_a_time_in_op_order(one_rank_group: Any) -> None:
    """What :class:`RankAgreement` does with the acks it holds: a step takes as many of each
    direction as every rank holds (here: all), oldest first, returned in op order; a wait
    for every write takes the writes only; acks put back come before those held after."""
    write, load = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE
    agreement = RankAgreement(one_rank_group)
    agreement.hold([_ack(1, write), _ack(2, load), _ack(3, write)])
    assert agreement.num_held == 3
    assert [a.op_id for a in agreement.take_writes()] == [1, 3]
    assert agreement.num_held == 1  # the load stays
    agreement.hold([_ack(4, write), _ack(5, load)])
    agreed, puts_back = agreement.agree(3)
    assert [a.op_id for a in agreed] == [2, 4, 5] and agreement.num_held == 0
    assert puts_back == 3
    assert agreement.agreements == 1
    agreement.hold([_ack(6, load)])
    agreement.put_back(agreed)
    assert agreement.num_held == 4
    assert [a.op_id for a in agreement.take_all()] == [2, 4, 5, 6]
    assert agreement.num_held == 0 and agreement.agreements == 1


def test_an_allocation_short_of_window_slots_applies_every_finished_write(
        one_rank_group: Any) -> None:
    """A hybrid rank whose sliding-window slots are all waiting for their host copies (pages
    that left the window, given back with ``release_window``): the allocation issues the
    queued copies, waits for every write and applies them all (every rank has them all
    then), so their window slots come free and it succeeds; the rank holds no write."""
    service = build_service(make_config("write_through", hybrid=True, device_tokens=8),
                            tp_group=one_rank_group)
    agreement = service._poller.agreement
    assert agreement is not None
    try:
        held = service.alloc_device(4)  # every window slot (4 of them)
        assert held is not None
        service.release_window(held)  # their rows go to the host; the slots come back after
        assert service.controller.has_queued_writes
        got = service.alloc_device(2)
        assert got is not None and not service.controller.has_queued_writes
        assert agreement.num_held == 0 and agreement.agreements == 0
        service.free_device(got)
        service.free_device(held)
    finally:
        service.stop()
    service.check_integrity()
