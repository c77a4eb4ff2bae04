"""The controller's ops from queuing to acknowledgement: queued calls per direction, their
merge into one op, the ops in flight (FIFO per direction), the slots they hold and the
observers told of every queued call.

Bookkeeping only (CPU, no stream): the controller issues the merged op on its side stream
and hands it back here; :meth:`OpQueue.pop_done` returns the finished ones in order.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence

from hicache.pools import DeviceKVPool, HostKVPool

from .base import Ack, Direction, MovedTransfer, PoolTransfer, TransferBackend, TransferOp
from .index_moves import cat_parts, move_checked, owned_copy
from .inflight import InFlightSlots

_DIRECTIONS = tuple(Direction)  # iterating the enum itself is a Python-level generator

# (direction, the queued call's pool transfers, its tag): see TransferCore.add_observer
TransferObserver = Callable[[Direction, Sequence[PoolTransfer], object], None]


class OpQueue:
    """Queued and in-flight ops of one controller.

    Args:
        pools: every pool the controller moves rows of (one per index space).
    """

    def __init__(self, pools: Sequence[DeviceKVPool | HostKVPool]) -> None:
        self.held = InFlightSlots(pools)
        self.observers: list[TransferObserver] = []
        self._op_ids = itertools.count()
        self._queued: dict[Direction, list[TransferOp]] = {d: [] for d in Direction}
        self._in_flight: dict[Direction, deque[TransferOp]] = {d: deque() for d in Direction}

    def queue(self, direction: Direction, transfers: list[PoolTransfer], tag: object) -> None:
        """Queue one call's transfers (their slots are held from now on) and tell the
        observers. The op keeps its own copies of the slots: a caller that changes its
        index tensors after the call (or the host slots it got back) cannot change what the
        op copies or unbalance the in-flight counts."""
        transfers = [owned_copy(t) for t in transfers]
        op = TransferOp(next(self._op_ids), direction, transfers, [tag], held=list(transfers))
        self.held.add(op, +1)
        self._queued[direction].append(op)
        for observer in list(self.observers):
            observer(direction, transfers, tag)

    def num_queued(self, direction: Direction) -> int:
        return len(self._queued[direction])

    def merge(self, direction: Direction, backend: TransferBackend) -> TransferOp | None:
        """One op from all queued calls of ``direction`` (indices concatenated per pool),
        its executor chosen by ``backend`` and its indices moved where that executor reads
        them; ``None`` when nothing is queued."""
        queued, self._queued[direction] = self._queued[direction], []
        if not queued:
            return None
        merged = []
        for i, first in enumerate(queued[0].transfers):
            parts = [op.transfers[i] for op in queued]
            merged.append(PoolTransfer(
                name=first.name, host_pool=first.host_pool, device_pool=first.device_pool,
                host_indices=cat_parts([p.host_indices for p in parts]),
                device_indices=cat_parts([p.device_indices for p in parts]),
                layers=first.layers,
            ))
        tags = [tag for op in queued for tag in op.tags]
        executor = backend.select(direction, merged[0].host_pool.layout, merged[0].num_tokens,
                                  layer_wise=direction is Direction.HOST_TO_DEVICE)
        op = TransferOp(next(self._op_ids), direction, merged, tags, backend=executor.name,
                        executor=executor, held=[t for part in queued for t in part.held])
        op.moved = move_op_indices(op)
        return op

    def issued(self, op: TransferOp) -> None:
        """``op`` was issued on its side stream: it is in flight until :meth:`pop_done`."""
        self._in_flight[op.direction].append(op)

    def in_flight(self, direction: Direction) -> Sequence[TransferOp]:
        return self._in_flight[direction]

    def pop_done(self) -> list[TransferOp]:
        """Issued ops whose finish event fired, FIFO per direction (``query()`` only); their
        slots are no longer held."""
        done: list[TransferOp] = []
        for direction in _DIRECTIONS:
            queue = self._in_flight[direction]
            while queue and queue[0].is_done():
                op = queue.popleft()
                self.held.add(op, -1)
                done.append(op)
        return done

    @property
    def num_ops(self) -> int:
        """Ops queued or issued and not yet acknowledged."""
        queued = sum(len(q) for q in self._queued.values())
        return queued + sum(len(q) for q in self._in_flight.values())


def move_op_indices(op: TransferOp) -> list[MovedTransfer]:
    """Move the indices of every pool transfer of ``op`` (its own list, so a pool kind added
    later is covered without touching call sites) where ``op.executor`` reads them. The
    op's indices are the queue's own copies, checked when their call was queued."""
    assert op.executor is not None, f"op {op.op_id} has no backend"
    executor = op.executor
    return [
        MovedTransfer(t, *move_checked(t.host_indices.tensor, t.device_indices.tensor,
                                       t.host_pool, t.device_pool, executor))
        for t in op.transfers
    ]


def acknowledgement(op: TransferOp) -> Ack:
    """The :class:`Ack` of a finished ``op`` (its duration from its timing events); the
    op's moved indices and temporaries are released."""
    duration = (
        op.start_event.elapsed_s(op.finish_event)
        if op.start_event is not None and op.finish_event is not None else None
    )
    ack = Ack(
        op.op_id, op.direction, op.tags,
        {t.name: t.num_tokens for t in op.transfers},
        {t.name: t.size_bytes for t in op.transfers},
        duration, op.backend,
    )
    op.moved.clear()
    op.keep_alive.clear()
    return ack
