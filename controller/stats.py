"""Plain counters the controller keeps; ``hicache.metrics`` reads them. No Prometheus here."""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache.pools.nonzero_count import count_nonzero
from hicache.pools.page_ids import is_run

from .base import Direction
from .inflight import host_pages_of

if TYPE_CHECKING:
    from .base import Ack, TransferOp

_VALUES = {d: d.value for d in Direction}  # Enum.value is a Python-level descriptor call


# Acks (and submissions) kept unfolded at most; a stats reader folds them sooner. The fold
# costs about 2 us an op wherever it runs, so this bounds the step that pays it: at 256 that
# step took 0.9-1.5 ms (the scheduler's step() p99.9 1.2 ms, p99 290-305 us, in the scheduler
# bench's cycle), at 32 about 0.15 ms (p99.9 240-310 us, p99 200-215 us; same median).
FOLD_EVERY = 32


@dataclass
class TransferStats:
    """Cumulative transfer counts, keyed by ``(direction value, pool name)``.

    ``durations`` holds ``(direction value, seconds)`` of acknowledged ops measured with
    device events, until a consumer calls :meth:`drain_durations`; with ``keep_durations``
    off (a service without a metrics endpoint, the only consumer) none are kept, where they
    piled up one per op for the engine's life.

    An acknowledgement is only appended (:meth:`on_ack`, on the scheduler's ``poll``); the
    counters it moves (``ops_acknowledged``, ``tokens``, ``bytes``, ``durations``) fold the
    appended acks when read, or every :data:`FOLD_EVERY` acks. Three counter updates per
    ack, with their tuple keys, were a quarter of a ``poll()``'s cost. A submission is
    appended the same way (:meth:`on_submit`: the op's direction, backend, host pages and
    pool names, not its index tensors) and folded into ``ops_submitted``, ``backend_ops``,
    ``host_runs`` and ``host_run_tokens`` with the acks: its four counter updates and run
    test were 1.5 us of a 20 us controller op.
    """

    _submitted: Counter[str] = field(default_factory=Counter)
    _backend_ops: Counter[tuple[str, str]] = field(default_factory=Counter)
    _host_runs: Counter[tuple[str, str]] = field(default_factory=Counter)
    _host_run_tokens: Counter[tuple[str, str]] = field(default_factory=Counter)
    _acked: Counter[str] = field(default_factory=Counter)
    _tokens: Counter[tuple[str, str]] = field(default_factory=Counter)
    _bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    _durations: list[tuple[str, float]] = field(default_factory=list)
    _unfolded: deque[Ack] = field(default_factory=deque)
    _unfolded_submits: deque[_Submission] = field(default_factory=deque)
    _fold_lock: threading.Lock = field(default_factory=threading.Lock)
    keep_durations: bool = True

    @property
    def ops_submitted(self) -> Counter[str]:
        self._fold()
        return self._submitted

    @property
    def backend_ops(self) -> Counter[tuple[str, str]]:
        self._fold()
        return self._backend_ops

    @property
    def host_runs(self) -> Counter[tuple[str, str]]:
        self._fold()
        return self._host_runs

    @property
    def host_run_tokens(self) -> Counter[tuple[str, str]]:
        self._fold()
        return self._host_run_tokens

    @property
    def ops_acknowledged(self) -> Counter[str]:
        self._fold()
        return self._acked

    @property
    def tokens(self) -> Counter[tuple[str, str]]:
        self._fold()
        return self._tokens

    @property
    def bytes(self) -> Counter[tuple[str, str]]:
        self._fold()
        return self._bytes

    @property
    def durations(self) -> list[tuple[str, float]]:
        self._fold()
        return self._durations

    @property
    def in_flight_ops(self) -> int:
        # acknowledged first: an op acked after this read was submitted before the next one,
        # so a reader beside the scheduler never sees more acks than submissions
        acknowledged = sum(self.ops_acknowledged.values())
        return sum(self.ops_submitted.values()) - acknowledged

    def on_submit(self, op: TransferOp) -> None:
        """Count the issued ``op`` and the runs of host slots it moves (folded when the
        counters are read, or with the acks)."""
        held, transfers = op.held, op.transfers
        if len(held) == 1 and len(transfers) == 1:  # one call of one pool pair: no loop
            call, transfer = held[0], transfers[0]
            pools: tuple[tuple[str, int, np.ndarray], ...] = (
                (transfer.name, transfer.host_pool.page_size, call.parts[0][1]),)
            ascending = call.host_ascending
        else:  # several pools, or merged calls (their host pages joined now)
            pools = tuple((t.name, t.host_pool.page_size, host_pages_of(op, i))
                          for i, t in enumerate(transfers))
            ascending = len(held) == 1 and held[0].host_ascending
        submits = self._unfolded_submits
        submits.append((op.direction, op.backend, ascending, pools))
        if len(submits) >= FOLD_EVERY:  # none pile up unread (the acks fold on their own)
            with self._fold_lock:
                self._fold_submits()

    def mean_host_run_tokens(self, direction: str, pool: str) -> float | None:
        """Mean length, in tokens, of the contiguous host-slot runs that ops of ``direction``
        touched in ``pool`` (how fragmented the host free list was; long runs mean long
        copies). ``None`` before any op."""
        runs = self.host_runs[(direction, pool)]
        return self.host_run_tokens[(direction, pool)] / runs if runs else None

    def on_ack(self, ack: Ack) -> None:
        """Count ``ack`` (folded into the counters when they are read)."""
        unfolded = self._unfolded
        unfolded.append(ack)  # a deque: appending while another thread folds is safe
        if len(unfolded) >= FOLD_EVERY:
            self._fold()

    def drain_durations(self) -> list[tuple[str, float]]:
        """Return and forget the measured durations."""
        self._fold()
        with self._fold_lock:
            drained, self._durations = self._durations, []
        return drained

    def _fold(self) -> None:
        """Move the appended submissions, then the appended acks, into the counters, one
        at a time off each deque's front (each is taken once, and one appended meanwhile,
        by the scheduler while a metrics reader folds, is neither lost nor counted twice),
        one folding thread at a time. Submissions first: an ack folded here had its op's
        submission appended before it, so no read counts more acks than submissions."""
        if self._unfolded_submits:
            with self._fold_lock:
                self._fold_submits()
        unfolded = self._unfolded
        if not unfolded:
            return
        acked, tokens, size = self._acked, self._tokens, self._bytes
        with self._fold_lock:
            durations = self._durations  # swapped by drain_durations, under this lock
            while unfolded:
                ack = unfolded.popleft()
                direction = _VALUES[ack.direction]
                acked[direction] += 1
                for pool, num_tokens in ack.tokens_by_pool.items():
                    tokens[(direction, pool)] += num_tokens
                for pool, size_bytes in ack.bytes_by_pool.items():
                    size[(direction, pool)] += size_bytes
                if ack.duration_s is not None and self.keep_durations:
                    durations.append((direction, ack.duration_s))

    def _fold_submits(self) -> None:
        """Count the appended submissions (under the fold lock): per op its direction and
        backend, and per pool the runs of host slots it moved (ops move whole pages, so
        runs of slots are runs of the pages the op holds: counted per page)."""
        submits = self._unfolded_submits
        submitted, backend_ops = self._submitted, self._backend_ops
        host_runs, host_run_tokens = self._host_runs, self._host_run_tokens
        while submits:
            op_direction, backend, ascending, pools = submits.popleft()
            direction = _VALUES[op_direction]
            submitted[direction] += 1
            backend_ops[(direction, backend)] += 1
            for name, page_size, pages in pools:
                size = pages.size
                if not size:
                    continue
                key = (direction, name)
                # distinct ascending pages are one run when they span their count
                one_run = ascending and pages.item(-1) - pages.item(0) == size - 1
                host_runs[key] += 1 if one_run else 1 + _breaks(pages, page_size, ascending)
                host_run_tokens[key] += size * page_size


# what on_submit appends: the op's direction and backend, whether its host pages are known
# ascending (one allocation's), and per pool transfer its name, host page size and host pages
_Submission = tuple[Direction, str, bool, tuple[tuple[str, int, np.ndarray], ...]]


def _breaks(pages: np.ndarray, page_size: int, ascending: bool = False) -> int:
    """Breaks between runs of the slots of whole ``pages`` sorted (allocations are
    ascending: sort only the rare rest): one per gap between pages and, as the slots of a
    page named twice interleave, ``page_size`` per repeat. ``ascending``: the pages are
    known distinct and ascending (an allocation's), so a break is a step over 1."""
    if pages.size == 1:
        return 0
    if ascending:
        return int(count_nonzero(pages[1:] - pages[:-1] != 1))
    if is_run(pages):
        return 0  # one ascending run (an allocation's)
    steps = np.diff(pages)
    if count_nonzero(steps < 0):
        steps = np.diff(np.sort(pages, kind="stable"))  # runs of pages: timsort's case
    breaks = int(count_nonzero(steps != 1))  # a gap or a repeat each
    if breaks:  # a repeat (two loads of one page) breaks page_size times
        breaks += (int(pages.size) - 1 - int(count_nonzero(steps))) * (page_size - 1)
    return breaks
