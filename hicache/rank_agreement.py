"""Tensor-parallel ranks that apply the same finished transfers at the same step.

An engine that runs one scheduler per tensor-parallel rank, each with its own service over its
own shard of the KV, needs every rank's tree to give the same answers: a match that finds 512
cached tokens on one rank and 256 on another makes the ranks compute different batches, and
the model's own collectives then hang or mix up requests. Every call an engine makes is the
same on every rank, and so is every decision the tree takes from them, except what follows
from a transfer's timing: when an ack is applied (a write-through backup locks its node
until its ack; a rank whose copy finished evicts that node, a rank whose copy is still
running evicts another) and what the shared store answered, and when.

With a :class:`RankAgreement` the service applies those only where every rank applies them:

- ``step()`` makes one collective, on every rank, whether or not anything finished: an
  all-gather of how many finished writes and loads each rank holds and how many leading
  store puts are back, of which every rank takes the minimum. Ops are issued in the same
  order on every rank (the scheduler's calls issue them; the background thread issues
  none), so the first ``n`` of each direction are the same ops everywhere, and every rank
  applies those ``n`` (by op id) and holds the rest for a later step. With a shared store,
  a second collective, of a length every rank knows from the first, agrees on those puts'
  results and on the prefetches' progress (:mod:`hicache.l3.held_jobs`).
- The first collective also compares what must be equal on every rank (free device and
  host tokens, store jobs held, open prefetches, whether the step raised on the rank, as
  below): ranks that differ there have diverged (an engine that made a call on one rank
  only, or a bug), and every rank raises :class:`RanksDivergedError` at the same step,
  instead of the model's collectives hanging later.
- Everywhere else no ack is applied: an allocation that evicted leaves them to the step,
  and what the background thread polls is held. After a wait for every write issued (an
  ``insert`` or ``free_device`` of pages whose sliding-window rows are being copied, an
  allocation short of sliding-window slots), every rank has all of them, so all writes are
  applied there without a collective; at ``stop``, every op.
- The background thread issues no backups (a quiet scheduler's backups wait for its next
  step) and evicts nothing; it still polls and runs the integrity check.

The collectives run on a ``torch.distributed`` process group that can reduce CPU tensors
(gloo): ``torch.distributed.new_group(ranks, backend="gloo")`` beside the model's NCCL group.

A ``step()`` that raises on one rank (a CUDA bounds error the device tripped, a backup's
issue or a poll that failed, or the rank's background thread that had failed) still takes
part in the first collective, which tells every rank:
every rank then raises :class:`RanksDivergedError` at that step (on the rank that failed,
with its own error as the cause), so none waits for it and none goes on a step ahead. A
step that raises on every rank (the same bad slot in every rank's forward) raises each
rank's own error, with what the step agreed held for the next, as on a service of its own.
``start_loading`` on a rank waits for the event set it reuses if that set's load still runs
(a service of its own raises instead): whether it still runs is each rank's timing.
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

# what every rank must have alike at a step (the first collective compares them)
_SAME = ("free device tokens", "free host tokens", "store puts held", "store prefetch jobs held",
         "open prefetches", "steps that raised")


class RanksDivergedError(RuntimeError):
    """The ranks' caches differ at a step (raised on every rank of the group at once)."""


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
        self.agreements = 0  # collectives made by step() (the one at build not counted)
        self._held: dict[Direction, collections.deque[Ack]] = {
            _WRITE: collections.deque(), _LOAD: collections.deque()}
        try:
            self.gather([0])
        except RuntimeError as error:
            raise ValueError(
                f"tp_group: the group cannot reduce CPU tensors ({error}); make one with a "
                f"CPU backend for the cache: torch.distributed.new_group(ranks, "
                f"backend='gloo')") from error

    @property
    def num_held(self) -> int:
        """Finished ops polled on this rank and not applied yet."""
        return len(self._held[_WRITE]) + len(self._held[_LOAD])

    def num_held_of(self, direction: Direction) -> int:
        """Finished ops of ``direction`` polled on this rank and not applied yet."""
        return len(self._held[direction])

    def hold(self, acks: list[Ack]) -> None:
        """Keep ``acks`` (oldest first) until the ranks agree on them."""
        for ack in acks:
            self._held[ack.direction].append(ack)

    def agree(self, puts_back: int = 0, same: tuple[int, ...] = (0,) * len(_SAME)
              ) -> tuple[list[Ack], int]:
        """The first collective of a step: the acks every rank holds, in op order (the rest
        stay held), and how many leading store puts are back on every rank (``puts_back``:
        this rank's count). ``same``: this rank's values of what must be equal everywhere
        (``_SAME``).

        Raises:
            RanksDivergedError: a value of ``same`` differs between ranks (nothing taken).
        """
        counts = [len(self._held[_WRITE]), len(self._held[_LOAD]), puts_back]
        by_rank = self.gather(counts + list(same))
        self.agreements += 1
        agreed = [min(column) for column in zip(*by_rank, strict=True)]
        differ = [f"{name} by rank: {', '.join(str(row[3 + i]) for row in by_rank)}"
                  for i, name in enumerate(_SAME) if len({row[3 + i] for row in by_rank}) > 1]
        if len({row[-1] for row in by_rank}) > 1:  # "steps that raised" (the last of _SAME)
            raise RanksDivergedError(
                f"step: the step raised on a tensor-parallel rank ({', '.join(differ)}, at "
                f"agreement {self.agreements}; that rank's error is the cause of its own "
                f"RanksDivergedError): the group cannot go on (restart it)")
        if differ:
            raise RanksDivergedError(
                f"step: the tensor-parallel ranks' caches differ ({', '.join(differ)}, "
                f"at agreement {self.agreements}): every rank must make the same service "
                f"calls with the same arguments in the same order; the group cannot go on "
                f"(restart it)")
        return self._take(agreed[0], agreed[1]), agreed[2]

    def agree_values(self, values: list[int]) -> list[int]:
        """A step's second collective: the minimum over ranks of each of ``values`` (of a
        length every rank knows); none when empty."""
        if not values:
            return []
        by_rank = self.gather(values)
        if len(values) <= 16:
            return [min(column) for column in zip(*by_rank, strict=True)]
        return torch.tensor(by_rank).amin(dim=0).tolist()  # type: ignore[no-any-return]

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

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (of one length on every rank), by rank. An all-gather,
        not an all-reduce: on gloo it takes about two thirds of the time of a minimum's
        all-reduce for more than two values (``docs/performance-log.md``)."""
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.all_gather(everyone, mine, group=self._group)  # type: ignore[arg-type]
        return [row.tolist() for row in everyone]


def agreed_step(service: HiCacheService) -> int:
    """``service.step()`` of a rank (see the module docstring): with the service lock held,
    issue the queued backups, make the step's collectives, then apply what they agreed. A
    rank whose background thread failed still makes the first one: every rank then raises
    ``RanksDivergedError`` (that rank's with its ``ServiceError`` as the cause) instead of
    the others waiting for it."""
    gate = service._gate
    failure = gate.failure()
    lock = None
    if failure is None:
        try:
            lock = gate.call()
        except RuntimeError:
            failure = gate.failure()  # the thread failed just now: step as below
            if failure is None:
                raise  # the service was stopped
    if lock is None:
        if gate.stopped:
            raise RuntimeError("the service was stopped")
        lock = gate.lock
    with lock:
        gate.check_open()
        return _agreed_step(service, failure)


def _agreed_step(service: HiCacheService, error: Exception | None) -> int:
    poller = service._poller
    agreement = poller.agreement
    assert agreement is not None
    storage = service.storage
    try:
        if error is None:
            service.controller.raise_if_tripped()
            service.tree.issue_queued_backups()  # those queued since the last step, one op
        poller.collect()  # held
        if storage is not None:
            storage.poll()  # the workers' finished lists emptied; nothing applied
    except Exception as exc:  # raised after the collectives, which every rank makes
        error = error or exc
    held = None
    if storage is not None:
        held = storage.held
        assert held is not None
    try:
        acks, puts_back = agreement.agree(0 if held is None else held.leading_puts_back(),
                                          (*_same_values(service), int(error is not None)))
    except RanksDivergedError as diverged:
        if error is not None:  # this rank's own error is why the others raise too
            raise diverged from error
        raise
    store_round = agreed = None
    if storage is not None:
        store_round = storage.round(puts_back)
        agreed = agreement.agree_values(store_round.values)
    if error is not None:  # it raised on every rank alike (else every rank raised above)
        agreement.put_back(acks)  # held on every rank, for the next step
        raise error
    poller.apply(acks)
    if storage is not None:
        assert store_round is not None and agreed is not None
        storage.apply_round(store_round, agreed)
    stats = service.stats
    stats.rank_agreements = agreement.agreements
    held_ops = stats.rank_held_ops
    held_ops["write"] = agreement.num_held_of(_WRITE)
    held_ops["load"] = agreement.num_held_of(_LOAD)
    held_ops["put"] = 0 if held is None else len(held.puts)
    held_ops["prefetch"] = 0 if held is None else len(held.prefetch_jobs)
    return len(acks)


def _same_values(service: HiCacheService) -> tuple[int, ...]:
    """What every rank must have alike at a step (``_SAME`` but the last, which the step
    adds: whether it raised on this rank)."""
    controller, storage = service.controller, service.storage
    held = None if storage is None else storage.held
    return (controller.device_allocator.num_free_tokens,
            controller.host_pool.allocator.num_free_tokens,
            0 if held is None else len(held.puts),
            0 if held is None else len(held.prefetch_jobs),
            0 if storage is None else len(storage.prefetches.open_prefetches()))
