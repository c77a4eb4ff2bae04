"""The background thread's integrity check, in slices that never hold the lock for long.

A full check of a large tree walks every node (hundreds of milliseconds at a million cached
tokens); holding the service lock for all of it would stall the scheduler. Here the walk
runs in slices of at most ``slice_s`` each under the lock, released in between, and the
comparison of what the nodes own with what the pools hold runs with no lock at all. A check
gives up (and a later one starts over) as soon as a scheduler call happens between two of
its slices: the tree it was walking may have changed, and a check of a mix of two trees
proves nothing. So every completed check saw one consistent state, and the scheduler waits
at most one slice for the lock.

A call counts itself before it waits for the lock, so one that counted before a check began
but took the lock only between two of its slices changes the tree unseen by that count; the
walk then reads a mix of two trees and may find an inconsistency that is not there. So a
sliced check reports nothing itself: what it finds is confirmed by the full check in one
hold of the lock (a stall, taken only when something looked wrong), which raises what it
finds; a finding it does not confirm is dropped and counted (``SliceStats.unconfirmed``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache.pools import Indices, PageAllocator
from hicache.pools.allocator import AllocatorSnapshot

from .radix import HiRadixCache
from .radix.integrity import TreeCheck

logger = logging.getLogger(__name__)


@dataclass
class SliceStats:
    """Counts of the sliced checks and the longest hold of the lock (read by benchmarks
    and tests)."""

    completed: int = 0
    abandoned: int = 0
    unconfirmed: int = 0  # findings the full check did not confirm (a call's race)
    slices: int = 0
    longest_slice_s: float = 0.0
    last_start: float = 0.0  # the latest slice's lock hold: from (perf_counter) ...
    last_s: float = 0.0  # ... for this long

    def record(self, start: float, seconds: float) -> None:
        self.slices += 1
        self.last_start, self.last_s = start, seconds
        self.longest_slice_s = max(self.longest_slice_s, seconds)


class SlicedIntegrityCheck:
    """One integrity check at a time, advanced a slice per :meth:`step`.

    Args:
        lock: the service lock (scheduler calls hold it while they change the tree).
        tree: the tree to check.
        engine_slots: the engine-held ``DEVICE_FULL`` slots, read under the lock.
        num_calls: how many scheduler calls have started so far (a call counts itself
            before it waits for the lock).
        slice_s: the longest the lock is held for the walk in one slice.
    """

    def __init__(self, lock: threading.Lock, tree: HiRadixCache,
                 engine_slots: Callable[[], Indices], num_calls: Callable[[], int],
                 slice_s: float = 0.0003) -> None:
        self._lock = lock
        self._tree = tree
        self._engine_slots = engine_slots
        self._num_calls = num_calls
        self.slice_s = slice_s
        self.stats = SliceStats()
        self._check: TreeCheck | None = None
        self._calls_at_start = 0

    @property
    def in_progress(self) -> bool:
        return self._check is not None

    def abandon(self) -> None:
        """Give up the check in progress, if any (its caller is about to change the tree,
        under the lock, between two slices); the next :meth:`step` starts a new one."""
        if self._check is not None:
            self._check = None
            self.stats.abandoned += 1

    def step(self) -> bool:
        """Run one slice if the lock is free right now (never waits for the scheduler);
        returns ``True`` when this slice completed a check. Raises ``RuntimeError`` for an
        inconsistency that the full check confirms (the next step starts a new check)."""
        try:
            return self._step()
        except Exception as found:
            self._check = None
            self._confirm(found)
            return False
        except BaseException:
            self._check = None
            raise

    def _confirm(self, found: Exception) -> None:
        """Run the full check in one hold of the lock after a slice found ``found``: it
        raises what it finds; if it finds nothing, ``found`` came from a tree that changed
        under the walk (see the module's docstring) and is dropped."""
        with self._lock:
            self._tree.check_integrity(engine_device=self._engine_slots(), sync_device=False)
        self.stats.unconfirmed += 1
        logger.info("integrity: a sliced check's finding was not confirmed by the full check "
                    "(the tree changed under the walk): %r", found)

    def _step(self) -> bool:
        if not self._lock.acquire(blocking=False):
            return False
        start = time.perf_counter()
        concluded = None
        allocators: list[tuple[PageAllocator, AllocatorSnapshot]] = []
        try:
            if self._check is None:
                self._calls_at_start = self._num_calls()
                self._check = TreeCheck(self._tree)
                # the CPU half of io.check_pools, on copies verified below with no lock
                allocators = [(a, a.integrity_snapshot())
                              for a in self._check.allocators.values()]
            elif self._num_calls() != self._calls_at_start:
                self._check = None  # the tree may have changed under the walk
                self.stats.abandoned += 1
            elif self._check.walk(deadline=start + self.slice_s):
                check, self._check = self._check, None
                concluded = (check, check.snapshot(self._engine_slots()))
        finally:
            self.stats.record(start, time.perf_counter() - start)
            self._lock.release()
        for allocator, copies in allocators:
            allocator.verify_snapshot(copies)
        if concluded is None:
            return False
        check, snapshot = concluded
        check.conclude(snapshot)  # no lock: only copies and the walk's own arrays
        self.stats.completed += 1
        return True
