"""The controller's ops from queuing to acknowledgement: queued calls per direction, their
merge into one op, the ops in flight (FIFO per direction), the pages they hold and the
observers told of every queued call.

Bookkeeping only (CPU, no stream): the controller issues the merged op on its side stream
and hands it back here; :meth:`OpQueue.pop_done` returns the finished ones in order.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from hicache.pools import DeviceKVPool, HostKVPool, IndexSpace, Indices

from .base import (
    BLOCK_MIN_ROWS,
    Ack,
    Direction,
    MovedTransfer,
    PoolTransfer,
    SlotPages,
    TransferBackend,
    TransferOp,
)
from .events import Event
from .index_moves import cat_parts, move_op_indices, owned_copy, reads_in_place
from .inflight import HeldCall, InFlightPages, pages_of_slots

_DIRECTIONS = tuple(Direction)  # iterating the enum itself is a Python-level generator
_LOAD = Direction.HOST_TO_DEVICE  # a member read through the class is a Python-level call
_WRITE = Direction.DEVICE_TO_HOST
assert set(_DIRECTIONS) == {_LOAD, _WRITE}, "OpQueue.num_ops counts two directions"
_OWN_EXECUTOR = TransferBackend.select  # a backend that does not override it executes its ops

# (direction, the queued call's pool transfers, its tag): see TransferCore.add_observer
TransferObserver = Callable[[Direction, Sequence[PoolTransfer], object], None]

# (host pages, device pages) of one pool transfer, from the checks where its slots entered
TransferPages = tuple[np.ndarray, np.ndarray]


class QueuedCall(NamedTuple):
    """One queued ``write``/``load``: the op's own copies of its transfers, its tag and
    the pages it holds."""

    transfers: list[PoolTransfer]
    tag: object
    held: HeldCall
    may_pad: bool  # its slots may name the padding slot (no entry check gave their pages)
    after: tuple[Event, ...]  # recorded on the callers' streams when queued (CUDA writes)


class OpQueue:
    """Queued and in-flight ops of one controller.

    Args:
        pools: every pool the controller moves rows of (one per index space),
            with the slots per page of the allocator that hands its slots out.
    """

    def __init__(self, pools: Sequence[tuple[DeviceKVPool | HostKVPool, int]]) -> None:
        self.held = InFlightPages(pools)
        self.observers: list[TransferObserver] = []
        self._op_ids = itertools.count()
        # bytes a token moves, by (device space, layers): one device pool per space
        self._bytes_per_token: dict[tuple[IndexSpace, int], int] = {}
        # whether a backend reads a space's op indices on the CPU as given (reads_in_place),
        # by (id of the backend, device space)
        self._in_place: dict[tuple[int, IndexSpace], tuple[TransferBackend, bool]] = {}
        # calls queued per direction, not issued yet (read, never changed, outside this class:
        # wait_until checks it per layer of every forward)
        self.queued: dict[Direction, list[QueuedCall]] = {d: [] for d in Direction}
        # issued ops with their finish events (read per poll without a call), FIFO
        self._in_flight: dict[Direction, deque[tuple[Event, TransferOp]]] = {
            d: deque() for d in Direction}

    def queue(self, direction: Direction, transfers: list[PoolTransfer], tag: object,
              pages: Sequence[TransferPages] | None = None, owned: bool = False,
              after: tuple[Event, ...] = (), cancel: Callable[[], object] = bool,
              host_ascending: bool = False) -> None:
        """Queue one call's transfers (their pages are held from now on) and tell the
        observers; an observer's exception un-queues the call, runs ``cancel`` (which frees
        the slots allocated for it: the caller never gets them) and reaches the caller. The
        op keeps its own copies of the slots: a caller that changes its index tensors after
        the call (or the host slots it got back) cannot change what the op copies or
        unbalance the in-flight counts.

        ``pages``: per transfer, the (host, device) page ids its slots' entry checks or
        allocations gave; found from the slots when ``None``. ``owned``: the transfers'
        index tensors are already int64 copies made for the queue (not copied again).
        ``after``: events the op waits on before it reads anything (the caller's stream
        when the call was queued, and any the caller marked earlier). ``host_ascending``:
        every transfer's host pages in ``pages`` are ascending (an allocation's)."""
        if not owned:
            transfers = [owned_copy(t) for t in transfers]
        may_pad = pages is None
        if pages is None:
            pages = [(self._pages_of(t.host_indices), self._pages_of(t.device_indices))
                     for t in transfers]
        if len(transfers) == 1:  # one pool pair (a full-attention model): no loop
            transfer, (host_pages, device_pages) = transfers[0], pages[0]
            parts: tuple[tuple[IndexSpace, np.ndarray], ...] = (
                (transfer.host_indices.space, host_pages),
                (transfer.device_indices.space, device_pages))
        else:
            parts = tuple(part for transfer, (host_pages, device_pages)
                          in zip(transfers, pages, strict=True)
                          for part in ((transfer.host_indices.space, host_pages),
                                       (transfer.device_indices.space, device_pages)))
        held = HeldCall(direction, parts, host_ascending and not may_pad)
        call = QueuedCall(transfers, tag, held, may_pad, after)
        queued = self.queued[direction]
        self.held.take(held)
        try:
            queued.append(call)
            if self.observers:
                for observer in list(self.observers):
                    observer(direction, transfers, tag)
        except BaseException:
            # an observer's exception (or a Ctrl-C) cancels the call: its caller never gets
            # the slots, so an op it could not track must not run
            if queued and queued[-1] is call:
                queued.pop()
            self.held.give_back(held)
            cancel()
            raise

    def _pages_of(self, indices: Indices) -> np.ndarray:
        return pages_of_slots(indices.tensor.numpy(), self.held.page_sizes[indices.space])

    def num_queued(self, direction: Direction) -> int:
        return len(self.queued[direction])

    def merge(self, direction: Direction, backend: TransferBackend) -> TransferOp | None:
        """One op from all queued calls of ``direction`` (indices concatenated per pool),
        its executor chosen by ``backend`` and its indices moved where that executor reads
        them; ``None`` when nothing is queued."""
        queued = self.queued[direction]
        if not queued:
            return None
        self.queued[direction] = []
        try:
            op = self._merged(direction, backend, queued)
        except BaseException:  # an index move's allocation failed, a Ctrl-C: still queued
            self.queued[direction] = queued + self.queued[direction]
            raise
        op.calls = queued
        return op

    def requeue(self, op: TransferOp) -> None:
        """Queue the calls merged into ``op`` again, ahead of any queued since, after its
        issue raised (a staging buffer's allocation failed, a Ctrl-C between two copies):
        they keep their pages held, the next ``start_*`` issues them again, and the copies
        the failed issue made are repeated (the same rows to the same slots, later on the
        same stream)."""
        assert op.calls, f"op {op.op_id} was issued or merged from no call"
        self.queued[op.direction] = [*op.calls, *self.queued[op.direction]]  # type: ignore[list-item]
        op.calls = ()

    def _merged(self, direction: Direction, backend: TransferBackend,
                queued: list[QueuedCall]) -> TransferOp:
        """:meth:`merge` of the calls ``queued``, taken off the queue."""
        if len(queued) == 1:  # one call (most steps): its own transfers, nothing to join
            call = queued[0]
            merged, tags, held = call.transfers, [call.tag], [call.held]
            may_pad, after = call.may_pad, list(call.after)
        else:
            merged = [
                PoolTransfer(
                    name=first.name, host_pool=first.host_pool, device_pool=first.device_pool,
                    host_indices=cat_parts([c.transfers[i].host_indices for c in queued]),
                    device_indices=cat_parts([c.transfers[i].device_indices for c in queued]),
                    layers=first.layers,
                )
                for i, first in enumerate(queued[0].transfers)
            ]
            tags, held = [c.tag for c in queued], [c.held for c in queued]
            may_pad = any(c.may_pad for c in queued)
            after = [event for c in queued for event in c.after]
        first = merged[0]
        if type(backend).select is _OWN_EXECUTOR:  # no choice to make: skip its arguments
            executor = backend
        else:
            executor = backend.select(direction, first.host_pool.layout, first.num_tokens,
                                      layer_wise=direction is _LOAD, pairs=first)
        tokens, size = {}, {}
        for transfer in merged:
            num_tokens = transfer.host_indices.tensor.numel()
            tokens[transfer.name] = num_tokens
            size[transfer.name] = num_tokens * self._token_bytes(transfer)
        op = TransferOp(next(self._op_ids), direction, merged, tags, executor.name, executor,
                        held, after, tokens, size)
        op.moved = self._moved(op, executor, may_pad)
        return op

    def _moved(self, op: TransferOp, executor: TransferBackend, may_pad: bool
               ) -> list[MovedTransfer]:
        """:func:`move_op_indices`, or, when ``executor`` reads every transfer's indices on
        the CPU as they are and none may name the padding slot, the op's own tensors as
        they are (what ``move_checked`` would return, without its calls)."""
        if may_pad:
            return move_op_indices(op, may_pad)
        moved = []
        one_call = op.held[0] if len(op.held) == 1 else None
        for i, t in enumerate(op.transfers):
            key = (id(executor), t.device_indices.space)
            found = self._in_place.get(key)
            if found is None:  # kept with its answer, the executor's id is not reused
                found = self._in_place[key] = (executor, reads_in_place(executor, t))
            if not found[1]:  # the slots move: with their pages when one call's
                return move_op_indices(op, may_pad, None if one_call is None else [
                    self._slot_pages(one_call, j) for j in range(len(op.transfers))])
            host = t.host_indices.tensor  # short moves copy row by row: no pages read
            moved.append(MovedTransfer(t, host, t.device_indices.tensor,
                                       pages=None if one_call is None
                                       or host.numel() < BLOCK_MIN_ROWS
                                       else self._slot_pages(one_call, i)))
        return moved

    def _slot_pages(self, call: HeldCall, index: int) -> SlotPages:
        """The :class:`SlotPages` of the call's ``index``-th transfer: the page ids its entry
        checks or allocations gave (whole pages, in slot order)."""
        (host_space, host_pages), (device_space, device_pages) = call.parts[2 * index:2 * index + 2]
        sizes = self.held.page_sizes
        return SlotPages(host_pages, sizes[host_space], device_pages, sizes[device_space],
                         call.host_ascending)

    def _token_bytes(self, transfer: PoolTransfer) -> int:
        """``transfer.token_bytes``, found once per pool and layer count (per op it was a
        property and a geometry call per pool transfer)."""
        key = (transfer.device_indices.space, len(transfer.layers))
        found = self._bytes_per_token.get(key)
        if found is None:
            found = self._bytes_per_token[key] = transfer.token_bytes
        return found

    def issued(self, op: TransferOp) -> None:
        """``op`` was issued on its side stream (its finish event recorded): it is in flight
        until :meth:`pop_done`."""
        assert op.finish_event is not None, f"op {op.op_id} was issued without a finish event"
        self._in_flight[op.direction].append((op.finish_event, op))
        op.calls = ()

    def in_flight(self, direction: Direction) -> list[TransferOp]:
        return [op for _, op in self._in_flight[direction]]

    def pop_done(self) -> list[TransferOp]:
        """Issued ops whose finish event fired, FIFO per direction (``query()`` only); their
        pages are no longer held."""
        done: list[TransferOp] = []
        give_back = self.held.give_back
        for direction in _DIRECTIONS:
            queue = self._in_flight[direction]
            while queue and queue[0][0].query():
                op = queue.popleft()[1]
                for call in op.held:
                    give_back(call)
                done.append(op)
        return done

    @property
    def num_ops(self) -> int:
        """Ops queued or issued and not yet acknowledged (four lengths, no generator: an
        allocation that evicted asks before it polls)."""
        queued, in_flight = self.queued, self._in_flight
        return (len(queued[_WRITE]) + len(queued[_LOAD]) + len(in_flight[_WRITE])
                + len(in_flight[_LOAD]))


def acknowledgement(op: TransferOp) -> Ack:
    """The :class:`Ack` of a finished ``op`` (its duration from its timing events); the
    op's moved indices and temporaries are released."""
    start, finish = op.start_event, op.finish_event
    # (on a CPU every op shares one completed event, and has no duration)
    duration = (start.elapsed_s(finish) if start is not None and finish is not None
                and start is not finish else None)
    ack = Ack(op.op_id, op.direction, op.tags, op.tokens_by_pool, op.bytes_by_pool, duration,
              op.backend)
    op.moved.clear()
    op.keep_alive.clear()
    return ack
