"""Index of the maximal runs of free pages of one allocator.

Plain Python bookkeeping, updated in place: a free merges the freed run with its neighbours,
an allocation splits the run it draws on, so each costs a few dict, list and heap operations
per run touched, never a pass over the pool. :class:`~hicache.pools.PageAllocator` keeps its
boolean free map as the source of truth and checks this index against it.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import operator

import numpy as np

from .free_map_take import index_of_runs, runs_to_take
from .snapshot import check_run_views, runs_as_arrays


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

    def take_longest(self, num_pages: int) -> tuple[list[int], list[int]]:
        """Remove the lowest ``num_pages`` pages of the fewest longest runs that cover them
        (lower start first among equal lengths) and return them as ``(starts, lengths)``
        of the runs, longest first (ascending starts among equal lengths). The surplus,
        fewer pages than the shortest run chosen, is the top of the highest-starting one,
        left in the index.

        The caller ensures ``num_pages`` pages are free. A length class taken whole costs a
        sorted copy of its starts and C-level dict deletions, one taken in large part the
        same; a few runs of a class are popped from its heap. So an allocation drawing on
        thousands of one-page runs (a fragmented pool) costs a few list operations per run,
        not a heap pop and an index update each.
        """
        starts: list[int] = []
        lengths: list[int] = []
        covered = 0
        for length in reversed(self._lengths):
            count = -(-(num_pages - covered) // length)
            if count >= self._counts[length]:
                taken = self._take_class(length)
            else:
                taken = self._take_lowest(length, count)
            starts += taken
            lengths += itertools.repeat(length, len(taken))
            covered += len(taken) * length
            if covered >= num_pages:
                break
        else:
            raise AssertionError(f"free-run index holds {covered} pages, asked for {num_pages}")
        surplus = covered - num_pages
        if surplus:
            top = starts.index(max(starts))
            lengths[top] -= surplus
            self._insert(starts[top] + lengths[top], surplus)
        return starts, lengths

    def runs_to_take(self, num_pages: int) -> int:
        """How many runs :meth:`take_longest` of ``num_pages`` (free, and more than any run
        holds) would take: a step per length class, nothing changed."""
        return runs_to_take(self._lengths, self._counts, num_pages)

    def replace(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Hold exactly the runs ``(starts, lengths)`` (disjoint, none touching another,
        any order): the index rebuilt in bulk, at a cost per run held."""
        (self._length_of, self._start_of_end, self._lengths, self._starts,
         self._counts) = index_of_runs(starts, lengths)

    def add_many(self, starts: list[int], lengths: list[int]) -> None:
        """:meth:`add` of runs none of which touches another (the maximal runs of a set of
        freed pages). The runs that touch no run of the index, the most in a fragmented
        pool, join it per length class in bulk (C-level dict updates, and one heapify, or a
        push each when a few join a large class); the others merge one by one. Merging one
        cannot make another touch it: the freed runs do not touch one another, and the one
        it merged with was in the index already."""
        ends = list(map(operator.add, starts, lengths))
        below = self._start_of_end.keys() & starts
        above = self._length_of.keys() & ends
        if below or above:
            start_at = dict(zip(ends, starts, strict=True))
            merging = below | {start_at[end] for end in above}
            for start, length in zip(starts, lengths, strict=True):
                if start in merging:
                    self.add(start, length)
            kept = [(start, length) for start, length in zip(starts, lengths, strict=True)
                    if start not in merging]
            starts = [start for start, _ in kept]
            lengths = [length for _, length in kept]
            ends = [start + length for start, length in kept]
        if not starts:
            return
        self._length_of.update(zip(starts, lengths, strict=True))
        self._start_of_end.update(zip(ends, starts, strict=True))
        if min(lengths) == max(lengths):
            self._join_class(lengths[0], starts)
            return
        by_length: dict[int, list[int]] = {}
        for start, length in zip(starts, lengths, strict=True):
            by_length.setdefault(length, []).append(start)
        for length, group in by_length.items():
            self._join_class(length, group)

    def take(self, start: int, num_pages: int) -> None:
        """Remove the lowest ``num_pages`` pages of the run that starts at ``start``."""
        length = self._length_of.pop(start)
        if num_pages < length:
            self._move(start, length, start + num_pages, length - num_pages)
        else:
            self._forget(start, length)
            del self._start_of_end[start + length]

    def add(self, start: int, length: int) -> None:
        """Add pages ``[start, start + length)`` (none of them in a run), merged with the runs
        that touch them."""
        end = start + length
        below = self._start_of_end.pop(start, None)
        above = self._length_of.pop(end, None)
        if above is not None:
            del self._start_of_end[end + above]
            if below is None:  # the run above grows down
                self._move(end, above, start, above + length)
                return
            self._forget(end, above)
            length += above
        if below is None:
            self._insert(start, length)
        else:  # the run below grows up
            below_length = self._length_of.pop(below)
            self._move(below, below_length, below, below_length + length)

    def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)``, int64 arrays of shape ``[num_runs]``, ascending by start."""
        return runs_as_arrays(self._length_of)

    def check_integrity(self, name: str) -> None:
        """Raise ``RuntimeError`` unless the views agree (:func:`.snapshot.check_run_views`)."""
        check_run_views(name, self._length_of, self._start_of_end, self._lengths,
                        self._starts, self._counts)

    def _live_starts(self, length: int) -> list[int]:
        """The starts of the runs of ``length``, ascending. The heap holds them all and the
        stale entries of runs gone: none when it holds no more entries than live runs."""
        heap = self._starts[length]
        if len(heap) == self._counts[length]:
            return sorted(heap)
        length_of = self._length_of
        return sorted({start for start in heap if length_of.get(start) == length})

    def _take_class(self, length: int) -> list[int]:
        """Remove every run of ``length``; their starts, ascending."""
        taken = self._live_starts(length)
        self._forget_runs(length, taken)
        del self._counts[length], self._starts[length]
        del self._lengths[bisect.bisect_left(self._lengths, length)]
        return taken

    def _take_lowest(self, length: int, count: int) -> list[int]:
        """Remove the ``count`` lowest-starting runs of ``length`` (fewer than the class
        holds); their starts, ascending. A small share pops them from the heap, skipping
        stale and repeated entries (a start taken leaves ``_length_of``: a repeat reads as
        stale); a large one sorts the class once and keeps the rest as its heap."""
        heap = self._starts[length]
        length_of, start_of_end = self._length_of, self._start_of_end
        if count * 8 >= len(heap):
            live = self._live_starts(length)
            self._counts[length] -= count
            taken, self._starts[length] = live[:count], live[count:]
            self._forget_runs(length, taken)
            return taken
        self._counts[length] -= count
        taken = []
        while len(taken) < count:
            start = heapq.heappop(heap)
            if length_of.get(start) == length:
                del length_of[start], start_of_end[start + length]
                taken.append(start)
        return taken

    def _forget_runs(self, length: int, starts: list[int]) -> None:
        """Drop the runs of ``length`` at ``starts`` from the start and end maps (their
        class is the caller's): a loop for a few, C-level maps for many."""
        length_of, start_of_end = self._length_of, self._start_of_end
        if len(starts) <= 8:
            for start in starts:
                del length_of[start], start_of_end[start + length]
            return
        collections.deque(map(length_of.__delitem__, starts), maxlen=0)
        collections.deque(map(start_of_end.__delitem__, map(length.__add__, starts)), maxlen=0)

    def _join_class(self, length: int, starts: list[int]) -> None:
        """Count new runs of ``length`` (already in ``_length_of``) in their class."""
        count = self._counts.get(length, 0)
        self._counts[length] = count + len(starts)
        if not count:
            self._starts[length] = sorted(starts)
            bisect.insort(self._lengths, length)
            return
        heap = self._starts[length]
        if len(starts) * 8 < len(heap):  # a few into a large class: a push each
            for start in starts:
                heapq.heappush(heap, start)
            return
        heap += starts
        if len(heap) > 2 * (count + len(starts)) + 16:  # mostly stale: keep the live runs
            length_of = self._length_of
            heap[:] = sorted({s for s in heap if length_of.get(s) == length})
        else:
            heapq.heapify(heap)

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

    def _move(self, start: int, length: int, new_start: int, new_length: int) -> None:
        """The run ``(start, length)``, out of ``_length_of``, becomes ``(new_start,
        new_length)``: in place when it is alone in its class and its new length, in no
        class yet, keeps its place among ``_lengths`` (a pool of few runs)."""
        counts, lengths = self._counts, self._lengths
        if counts[length] == 1 and new_length not in counts:
            at = bisect.bisect_left(lengths, length)
            if ((not at or lengths[at - 1] < new_length)
                    and (at + 1 == len(lengths) or lengths[at + 1] > new_length)):
                lengths[at] = new_length
                del counts[length], self._starts[length]
                counts[new_length], self._starts[new_length] = 1, [new_start]
                self._length_of[new_start] = new_length
                self._start_of_end[new_start + new_length] = new_start
                return
        self._forget(start, length)
        self._insert(new_start, new_length)

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
