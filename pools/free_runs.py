"""Index of the maximal runs of free pages of one allocator.

Plain Python bookkeeping, updated in place: a free merges the freed run with its neighbours,
an allocation splits the run it draws on, so each costs a few dict, list and heap operations
per run touched, never a pass over the pool. :class:`~hicache.pools.PageAllocator` keeps its
boolean free map as the source of truth and checks this index against it in
``check_integrity``.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np


class FreeRuns:
    """Maximal runs of consecutive free pages among pages ``[1, num_pages]``.

    Args:
        num_pages: usable pages; all of them start free, as one run from page 1.

    A run is ``(start, length)`` covering pages ``[start, start + length)``. Runs are kept
    by start (``_length_of``), by end (``_start_of_end``, to merge a freed run with the run
    just below it) and by length: ``_lengths`` lists the lengths some run has, ascending (a
    plain list: distinct lengths of disjoint runs number at most ``sqrt(2 * num_pages)``),
    and ``_starts[length]`` is a heap of the starts of the runs of that length. "The
    smallest run of at least n pages, lowest first" is then one bisection and a look at a
    heap's top. A run leaving the index stays in its heap until it reaches the top (a
    lazy deletion: an entry counts only while ``_length_of`` still gives it that length);
    ``_counts[length]`` counts the live runs, and a heap is dropped with its last run and
    compacted when stale entries outnumber live ones.
    """

    def __init__(self, num_pages: int) -> None:
        self._length_of: dict[int, int] = {}
        self._start_of_end: dict[int, int] = {}
        self._lengths: list[int] = []
        self._starts: dict[int, list[int]] = {}
        self._counts: dict[int, int] = {}
        self._insert(1, num_pages)

    def __len__(self) -> int:
        """Number of runs."""
        return len(self._length_of)

    def best_fit(self, num_pages: int) -> int | None:
        """Start of the smallest run of at least ``num_pages`` pages (the lowest-starting one
        among equal lengths), or ``None`` when no run is that long."""
        lengths = self._lengths
        at = bisect.bisect_left(lengths, num_pages)
        if at == len(lengths):
            return None
        length = lengths[at]
        heap = self._starts[length]
        length_of = self._length_of
        start = heap[0]
        while length_of.get(start) != length:  # stale: the run left or changed length
            heapq.heappop(heap)
            start = heap[0]
        return start

    def longest_first(self, num_pages: int) -> list[tuple[int, int]]:
        """``(start, length)`` of the longest runs (lower start first among equal lengths),
        as few as cover ``num_pages`` pages.

        The caller ensures ``num_pages`` pages are free. Costs a copy of the heap of each
        length visited (a C-level list copy) and a heap pop per run returned.
        """
        runs: list[tuple[int, int]] = []
        covered = 0
        length_of = self._length_of
        for length in reversed(self._lengths):
            heap = list(self._starts[length])  # popping the copy leaves the index alone
            seen: set[int] = set()
            while heap and covered < num_pages:
                start = heapq.heappop(heap)
                if start in seen or length_of.get(start) != length:
                    continue  # a repeated or stale entry
                seen.add(start)
                runs.append((start, length))
                covered += length
            if covered >= num_pages:
                return runs
        raise AssertionError(f"free-run index holds {covered} pages, asked for {num_pages}")

    def take(self, start: int, num_pages: int) -> None:
        """Remove the lowest ``num_pages`` pages of the run that starts at ``start``."""
        length = self._length_of.pop(start)
        end = start + length
        self._forget(start, length)
        if num_pages < length:
            self._insert(start + num_pages, length - num_pages)
        else:
            del self._start_of_end[end]

    def add(self, start: int, length: int) -> None:
        """Add pages ``[start, start + length)`` (none of them in a run), merged with the runs
        that touch them."""
        end = start + length
        below = self._start_of_end.pop(start, None)
        if below is not None:
            self._forget(below, self._length_of.pop(below))
            start = below
        above = self._length_of.pop(end, None)
        if above is not None:
            self._forget(end, above)
            del self._start_of_end[end + above]
            end += above
        self._insert(start, end - start)

    def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)``, int64 arrays of shape ``[num_runs]``, ascending by start."""
        count = len(self._length_of)
        starts = np.fromiter(self._length_of.keys(), dtype=np.int64, count=count)
        lengths = np.fromiter(self._length_of.values(), dtype=np.int64, count=count)
        order = np.argsort(starts, kind="stable")
        return starts[order], lengths[order]

    def check_integrity(self, name: str) -> None:
        """Raise ``RuntimeError`` unless the views of the runs agree and no two runs touch or
        overlap."""
        by_end = {start + length: start for start, length in self._length_of.items()}
        counts: dict[int, int] = {}
        for length in self._length_of.values():
            counts[length] = counts.get(length, 0) + 1
        if (by_end != self._start_of_end or counts != self._counts
                or self._lengths != sorted(counts) or self._starts.keys() != counts.keys()):
            raise RuntimeError(f"pool '{name}': free-run index views disagree")
        for start, length in self._length_of.items():
            if start not in self._starts[length]:
                raise RuntimeError(f"pool '{name}': free run at page {start} is missing from "
                                   f"the index of runs of {length} pages")
        starts, lengths = self.as_arrays()
        if (lengths < 1).any() or (starts[1:] <= starts[:-1] + lengths[:-1]).any():
            raise RuntimeError(f"pool '{name}': free-run index has empty, touching or "
                               f"overlapping runs")

    def _insert(self, start: int, length: int) -> None:
        self._length_of[start] = length
        self._start_of_end[start + length] = start
        count = self._counts.get(length, 0)
        self._counts[length] = count + 1
        if not count:
            self._starts[length] = [start]
            bisect.insort(self._lengths, length)
            return
        heap = self._starts[length]
        heapq.heappush(heap, start)
        if len(heap) > 2 * count + 16:  # mostly stale: rebuild from the live runs
            length_of = self._length_of
            heap[:] = sorted({s for s in heap if length_of.get(s) == length})

    def _forget(self, start: int, length: int) -> None:
        """The run ``(start, length)`` left ``_length_of``: uncount it by length."""
        count = self._counts[length] - 1
        if count:
            self._counts[length] = count
            heap = self._starts[length]
            if heap[0] == start:
                heapq.heappop(heap)
            return
        del self._counts[length], self._starts[length]
        del self._lengths[bisect.bisect_left(self._lengths, length)]
