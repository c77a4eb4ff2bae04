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


FOLD_EVERY = 256  # acks kept unfolded at most (a stats reader folds them sooner)


@dataclass
class TransferStats:
    """Cumulative transfer counts, keyed by ``(direction value, pool name)``.

    ``durations`` holds ``(direction value, seconds)`` of acknowledged ops measured with
    device events, until a consumer calls :meth:`drain_durations`.

    An acknowledgement is only appended (:meth:`on_ack`, on the scheduler's ``poll``); the
    counters it moves (``ops_acknowledged``, ``tokens``, ``bytes``, ``durations``) fold the
    appended acks when read, or every :data:`FOLD_EVERY` acks. Three counter updates per
    ack, with their tuple keys, were a quarter of a ``poll()``'s cost.
    """

    ops_submitted: Counter[str] = field(default_factory=Counter)
    backend_ops: Counter[tuple[str, str]] = field(default_factory=Counter)
    host_runs: Counter[tuple[str, str]] = field(default_factory=Counter)
    host_run_tokens: Counter[tuple[str, str]] = field(default_factory=Counter)
    _acked: Counter[str] = field(default_factory=Counter)
    _tokens: Counter[tuple[str, str]] = field(default_factory=Counter)
    _bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    _durations: list[tuple[str, float]] = field(default_factory=list)
    _unfolded: deque[Ack] = field(default_factory=deque)
    _fold_lock: threading.Lock = field(default_factory=threading.Lock)

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
        """Count the issued ``op`` and the runs of host slots it moves (ops move whole
        pages, so runs of slots are runs of the pages the op holds: counted per page, not
        per slot)."""
        direction = _VALUES[op.direction]
        self.ops_submitted[direction] += 1
        self.backend_ops[(direction, op.backend)] += 1
        held = op.held
        ascending = len(held) == 1 and held[0].host_ascending
        for i, transfer in enumerate(op.transfers):
            pages = held[0].parts[2 * i][1] if len(held) == 1 else host_pages_of(op, i)
            size = pages.size
            if not size:
                continue
            page_size = transfer.host_pool.page_size
            key = (direction, transfer.name)
            # distinct ascending pages are one run when they span their count (no array call)
            one_run = ascending and pages.item(-1) - pages.item(0) == size - 1
            self.host_runs[key] += 1 if one_run else 1 + _breaks(pages, page_size, ascending)
            self.host_run_tokens[key] += size * page_size

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
        """Move the appended acks into the counters, one at a time off the deque's front
        (each is taken once, and one appended meanwhile, by the scheduler while a metrics
        reader folds, is neither lost nor counted twice), one folding thread at a time."""
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
                if ack.duration_s is not None:
                    durations.append((direction, ack.duration_s))


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
