"""Which pages queued or issued transfer ops hold: per index space, a count of the writes and
of the loads that hold each page, so eviction can refuse a slot in flight and a new op can
refuse a slot another op would race.

Bookkeeping only (numpy on the CPU, no stream). Ops move whole pages (their slots come from
an allocator or from an entry check of whole pages), so a page is the unit: a call of 256
pages costs one array operation, not one per slot, and a slot is in flight exactly when its
page is. Both counts of a page share one int64 word (writes in the low 32 bits, loads in the
high ones), so a new write's conflict check, an eviction's check and the take or give-back
of a call are one array operation each. Counts are taken and given back per queued call
(:class:`HeldCall`), where no page repeats, so ops merged from several calls balance exactly
even when two calls name one host page.

A call's pages enter the counts only when a check reads them: a call taken and given back
with no check in between (a scheduler that acknowledges each op before it checks the next)
never touches the arrays, and a check with no call held has nothing to look up. A check
first counts every call kept aside, so each answer is the one counts kept eagerly would give.

Conflicts refused for a new op (the side streams do not wait for each other):

- a write's device slots must not be held by another write (a second backup of a page) or
  by a load (the write would read rows the load has not placed yet);
- a load's host slots must not be held by a write (the load would read rows the write has
  not placed yet). Two loads may read one host page.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from hicache.pools import DeviceKVPool, HostKVPool, IndexSpace
from hicache.pools.nonzero_count import count_nonzero

from .base import Direction, TransferOp

Pool = DeviceKVPool | HostKVPool

WRITE_UNIT = 1  # a write adds this to each page it holds
LOAD_UNIT = 1 << 32  # a load adds this
WRITE_MASK = LOAD_UNIT - 1  # the write count of a word

_UNIT = {Direction.DEVICE_TO_HOST: WRITE_UNIT, Direction.HOST_TO_DEVICE: LOAD_UNIT}
# the counts a new op of a direction must find at zero, checked in this order
_CONFLICTS: dict[Direction, tuple[tuple[int, str], ...]] = {
    Direction.DEVICE_TO_HOST: (
        (WRITE_MASK, "is already being backed up by a queued or in-flight write; back a page "
         "up once (its host copy comes with that write's ack)"),
        (~WRITE_MASK, "is still being filled by a queued or in-flight load; back it up after "
         "poll() acknowledged that load (the write stream does not wait for the load "
         "stream)"),
    ),
    Direction.HOST_TO_DEVICE: (
        (WRITE_MASK, "is still being filled by a queued or in-flight write; load it after "
         "poll() acknowledged that write (the load stream does not wait for the write "
         "stream)"),
    ),
}


class HeldCall(NamedTuple):
    """The pages one queued call holds: ``parts`` are ``(space, pages)`` with distinct int64
    page ids (never page 0), two per pool transfer of the call, host then device.
    ``host_ascending``: every host part's pages are ascending (an allocation's), so one
    comparison of the first and last tells whether they are a single run."""

    direction: Direction
    parts: tuple[tuple[IndexSpace, np.ndarray], ...]
    host_ascending: bool = False


class InFlightPages:
    """Per-page write and load counts of the ops that hold each page of the controller's pools.

    Args:
        pools: every pool the controller moves rows of (one per index space), each with the
            slots per page of the allocator that hands its slots out.
    """

    def __init__(self, pools: Sequence[tuple[Pool, int]]) -> None:
        self._pools = {pool.space: pool for pool, _ in pools}
        self.page_sizes = {pool.space: page_size for pool, page_size in pools}
        self._counts = {pool.space: np.zeros(-(-pool.num_slots // page_size), dtype=np.int64)
                        for pool, page_size in pools}
        # the queued calls holding pages now, by id (for busy_slots)
        self._held: dict[int, HeldCall] = {}
        # those of them not in _counts yet (see the module's docstring), by id
        self._uncounted: dict[int, HeldCall] = {}

    def pool(self, space: IndexSpace, op: str) -> Pool:
        """The pool of ``space``; ``ValueError`` naming the spaces there are otherwise."""
        pool = self._pools.get(space)
        if pool is None:
            have = ", ".join(s.name for s in self._pools)
            raise ValueError(
                f"{op}: this controller has no pool in index space {space.name}; it has {have}"
            )
        return pool

    def take(self, call: HeldCall) -> None:
        """Hold the pages of ``call`` until :meth:`give_back` (counted at the next check)."""
        key = id(call)
        self._held[key] = call
        self._uncounted[key] = call

    def give_back(self, call: HeldCall) -> None:
        """Release the pages :meth:`take` held for ``call``."""
        key = id(call)
        del self._held[key]
        if self._uncounted.pop(key, None) is None:  # a check counted it: uncount it
            _bump(self._counts, call, -_UNIT[call.direction])

    def _counted(self, space: IndexSpace) -> np.ndarray:
        """The counts of ``space`` with every held call in them."""
        uncounted = self._uncounted
        for key, call in list(uncounted.items()) if uncounted else ():
            _bump(self._counts, call, _UNIT[call.direction])
            del uncounted[key]
        return self._counts[space]

    def mask(self, space: IndexSpace, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` (checked, in range) any op holds."""
        if not self._held:
            return np.zeros(slots.shape, dtype=bool)
        return self._counted(space)[slots // self.page_sizes[space]] != 0

    def first_busy_page(self, space: IndexSpace, pages: np.ndarray) -> int | None:
        """The first of ``pages`` (checked, in range) that any op holds, or ``None``."""
        if not self._held:
            return None
        counts = self._counted(space)
        if pages.size == 1:
            page = pages.item()
            return page if counts[page] else None
        held = counts[pages]
        if not count_nonzero(held):
            return None
        return int(pages[np.flatnonzero(held)[0]])

    def held_slots(self, space: IndexSpace) -> np.ndarray:
        """Every slot of ``space`` an op holds, ascending (from the calls themselves, so the
        cost follows the pages in flight, not the pool's size)."""
        self.pool(space, "busy_slots")
        parts = [pages for call in self._held.values() for part_space, pages in call.parts
                 if part_space is space]
        if not parts:
            return np.empty(0, dtype=np.int64)
        pages = np.unique(np.concatenate(parts))
        page_size = self.page_sizes[space]
        offsets = np.arange(page_size, dtype=np.int64)
        return (pages[:, None] * page_size + offsets).reshape(-1)

    def refuse_conflicts(self, space: IndexSpace, pages: np.ndarray, op: str,
                         new_op: Direction, slots: np.ndarray | None = None) -> None:
        """Raise ``ValueError`` if an op that a new ``new_op`` op would race holds one of
        ``pages`` (checked page ids of the new op's source slots), naming the first slot of
        the first such page (or, given the ``slots`` those pages are of, one per slot, the
        first such slot)."""
        if not self._held:
            return
        counts = self._counted(space)
        if pages.size == 1:
            word = int(counts[pages[0]])
            if not word:
                return
            held = np.array([word], dtype=np.int64)
        else:
            held = counts[pages]
            if not count_nonzero(held):
                return
        for mask, why in _CONFLICTS[new_op]:
            hit = np.flatnonzero(held & mask)
            if hit.size:
                at = int(hit[0])
                slot = (int(pages[at]) * self.page_sizes[space] if slots is None
                        else int(slots[at]))
                raise ValueError(
                    f"{op}: {space.name} slot {slot} of pool '{self.pool(space, op).name}' {why}"
                )

    def refuse_slot_conflicts(self, space: IndexSpace, slots: np.ndarray, op: str,
                              new_op: Direction) -> None:
        """:meth:`refuse_conflicts` for checked slots that need not be whole pages."""
        if slots.size:
            self.refuse_conflicts(space, slots // self.page_sizes[space], op, new_op,
                                  slots=slots)


def host_pages_of(op: TransferOp, index: int) -> np.ndarray:
    """The host page ids of ``op.transfers[index]`` in slot order (every merged call's)."""
    parts = [call.parts[2 * index][1] for call in op.held]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def pages_of_slots(slots: np.ndarray, page_size: int) -> np.ndarray:
    """Distinct pages (int64, page 0 left out) of any slots: the form a call's slots are held
    in when no entry check gave their pages (a hybrid op's SWA slots). Slots in
    non-decreasing order (an allocation's, most often) keep the first of each page's run
    without a sort; others go through ``np.unique``."""
    pages = slots.astype(np.int64, copy=False) // page_size
    if pages.size > 1:
        later = pages[1:]
        if count_nonzero(later < pages[:-1]):
            pages = np.unique(pages)
        else:
            first = np.empty(pages.size, dtype=bool)
            first[0] = True
            np.not_equal(later, pages[:-1], out=first[1:])
            pages = pages[first]
    return pages[pages != 0]


def _bump(counts: dict[IndexSpace, np.ndarray], call: HeldCall, delta: int) -> None:
    for space, pages in call.parts:
        if pages.size == 1:  # one page: an item update with a Python int, no numpy scalar
            counts[space][pages.item()] += delta
        elif pages.size:
            counts[space][pages] += delta  # distinct pages: fancy += adds once each
