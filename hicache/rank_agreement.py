"""Tensor-parallel ranks that apply the same finished transfers at the same step.

An engine that runs one scheduler per tensor-parallel rank, each with its own service over its
own shard of the KV, needs every rank's tree to give the same answers: a match that finds 512
cached tokens on one rank and 256 on another makes the ranks compute different batches, and
the model's own collectives then hang or mix up requests. Every call an engine makes is the
same on every rank, and so is every decision the tree takes from them, except one: when a
transfer's acknowledgement is applied. A write-through backup locks its node until its ack;
a rank whose copy finished evicts that node, a rank whose copy is still running evicts
another, and from then on their matches differ.

With a :class:`RankAgreement` the service applies acks only where every rank applies them:

- ``step()`` makes exactly one collective, on every rank, whether or not anything finished:
  an all-reduce (minimum) of how many finished writes and loads each rank holds. Ops are
  issued in the same order on every rank (the scheduler's calls issue them; the background
  thread issues none), so the first ``n`` of each direction are the same ops everywhere, and
  every rank applies those ``n`` (by op id) and holds the rest for a later step.
- Everywhere else no ack is applied: an allocation that evicted leaves them to the step,
  and what the background thread polls is held. After a wait for every write issued (an
  ``insert`` or ``free_device`` of pages whose sliding-window rows are being copied, an
  allocation short of sliding-window slots), every rank has all of them, so all writes are
  applied there without a collective; at ``stop``, every op.
- The background thread issues no backups (a quiet scheduler's backups wait for its next
  step) and evicts nothing; it still polls and runs the integrity check.

The collective runs on a ``torch.distributed`` process group that can reduce CPU tensors
(gloo): ``torch.distributed.new_group(ranks, backend="gloo")`` beside the model's NCCL group.
A shared store (L3) is refused with a group: its prefetches finish on each rank's own
schedule, and the ranks do not agree on them yet.

A ``step()`` that raises a CUDA bounds error still takes part in the collective first (so no
other rank waits for it), then raises with the agreed acks held back: that rank is then a
step behind the others, and an engine should treat the error as fatal for the whole group.
Not agreed yet: ``start_loading`` refuses a load while the event set it would reuse still
runs, which depends on each rank's timing (an engine keeps ``controller.event_ring_size``
above the load batches it has in flight).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import torch

from hicache.controller import Ack
from hicache.controller.base import Direction

if TYPE_CHECKING:
    from .service import HiCacheService

_WRITE, _LOAD = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE


class RankAgreement:
    """The acks one rank holds until the ranks of ``group`` agree to apply them.

    Args:
        group: a ``torch.distributed`` process group with a CPU backend (gloo), of the
            ranks that serve the same requests, each with its own service; ``None`` for the
            default group. Every rank builds its agreement at the same point (building
            makes one collective, which checks that the group reduces CPU tensors).

    Raises:
        ValueError: ``torch.distributed`` is not initialised, or the group cannot reduce
            CPU tensors (an NCCL-only group).
    """

    def __init__(self, group: object = None) -> None:
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("tp_group: torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first, on every rank")
        self._group = group
        self.size: int = dist.get_world_size(group)  # type: ignore[arg-type]
        self.rank: int = dist.get_rank(group)  # type: ignore[arg-type]
        self._counts = torch.zeros(2, dtype=torch.int64)
        self.agreements = 0  # collectives made by step() (the one at build not counted)
        self._held: dict[Direction, collections.deque[Ack]] = {
            _WRITE: collections.deque(), _LOAD: collections.deque()}
        try:
            self._all_reduce_min(0, 0)
        except RuntimeError as error:
            raise ValueError(
                f"tp_group: the group cannot reduce CPU tensors ({error}); make one with a "
                f"CPU backend for the cache: torch.distributed.new_group(ranks, "
                f"backend='gloo')") from error

    @property
    def num_held(self) -> int:
        """Finished ops polled on this rank and not applied yet."""
        return len(self._held[_WRITE]) + len(self._held[_LOAD])

    def hold(self, acks: list[Ack]) -> None:
        """Keep ``acks`` (oldest first) until the ranks agree on them."""
        for ack in acks:
            self._held[ack.direction].append(ack)

    def agree(self) -> list[Ack]:
        """The one collective of a step: the acks every rank holds, in op order (the rest
        stay held)."""
        writes, loads = self._all_reduce_min(len(self._held[_WRITE]), len(self._held[_LOAD]))
        self.agreements += 1
        return self._take(writes, loads)

    def take_writes(self) -> list[Ack]:
        """Every held write: the caller waited for every write issued, on every rank."""
        return self._take(len(self._held[_WRITE]), 0)

    def take_all(self) -> list[Ack]:
        """Everything held (at ``stop``, once every op finished)."""
        return self._take(len(self._held[_WRITE]), len(self._held[_LOAD]))

    def put_back(self, acks: list[Ack]) -> None:
        """Hold ``acks`` (taken by :meth:`agree`) again, before anything held after them."""
        for ack in reversed(acks):
            self._held[ack.direction].appendleft(ack)

    def _take(self, writes: int, loads: int) -> list[Ack]:
        taken = [self._held[_WRITE].popleft() for _ in range(writes)]
        taken += [self._held[_LOAD].popleft() for _ in range(loads)]
        taken.sort(key=lambda ack: ack.op_id)
        return taken

    def _all_reduce_min(self, writes: int, loads: int) -> tuple[int, int]:
        counts = self._counts
        counts[0], counts[1] = writes, loads
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MIN,
                                     group=self._group)  # type: ignore[arg-type]
        return int(counts[0]), int(counts[1])


def agreed_step(service: HiCacheService) -> int:
    """``service.step()`` of a rank (see the module docstring), with the service lock held:
    issue the queued backups, make the step's collective, then apply what it agreed."""
    poller = service._poller
    agreement = poller.agreement
    assert agreement is not None and service.storage is None
    error: Exception | None = None
    try:
        service.controller.raise_if_tripped()
        service.tree.issue_queued_backups()  # those queued since the last step, as one op
    except Exception as exc:  # raised after the collective, which every rank makes
        error = exc
    acks = poller.collect(agree=True)
    if error is not None:
        agreement.put_back(acks)
        raise error
    poller.apply(acks)
    return len(acks)
