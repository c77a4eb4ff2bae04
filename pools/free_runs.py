"""Index of the maximal runs of free pages of one allocator.

Plain Python bookkeeping, updated in place: a free merges the freed run with its neighbours,
an allocation splits the run it draws on, so each costs a few dict and sorted-list operations
per run touched, never a pass over the pool. :class:`~hicache.pools.PageAllocator` keeps its
boolean free map as the source of truth and checks this index against it in
``check_integrity``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

import numpy as np

try:
    from sortedcontainers import SortedList
except ImportError:  # a machine that installed hicache without its dependencies
    SortedList = None


class SortedInts:
    """The part of ``sortedcontainers.SortedList`` the index uses, over one Python list
    (same results; inserts and removals move the tail, O(n)). Used only where that package
    is not installed."""

    def __init__(self) -> None:
        self._keys: list[int] = []

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __getitem__(self, index: int) -> int:
        return self._keys[index]

    def add(self, key: int) -> None:
        bisect.insort(self._keys, key)

    def remove(self, key: int) -> None:
        at = bisect.bisect_left(self._keys, key)
        if at == len(self._keys) or self._keys[at] != key:
            raise ValueError(f"{key} is not in the list")
        del self._keys[at]

    def bisect_left(self, key: int) -> int:
        return bisect.bisect_left(self._keys, key)

    def irange(self, minimum: int | None = None, maximum: int | None = None,
               inclusive: tuple[bool, bool] = (True, True), reverse: bool = False
               ) -> Iterator[int]:
        keys = self._keys
        low = 0 if minimum is None else (bisect.bisect_left(keys, minimum) if inclusive[0]
                                         else bisect.bisect_right(keys, minimum))
        high = len(keys) if maximum is None else (
            bisect.bisect_right(keys, maximum) if inclusive[1]
            else bisect.bisect_left(keys, maximum))
        chosen = keys[low:high]
        return reversed(chosen) if reverse else iter(chosen)


def sorted_ints() -> Any:
    """A ``SortedList`` when sortedcontainers is installed, else a :class:`SortedInts`."""
    return SortedInts() if SortedList is None else SortedList()


class FreeRuns:
    """Maximal runs of consecutive free pages among pages ``[1, num_pages]``.

    Args:
        num_pages: usable pages; all of them start free, as one run from page 1.

    A run is ``(start, length)`` covering pages ``[start, start + length)``. Runs are kept
    by start (``_length_of``), by end (``_start_of_end``, to merge a freed run with the run
    just below it) and by ``(length, start)`` packed into one int (``_by_size``, ascending),
    which answers "smallest run of at least n pages, lowest first" with one bisection.
    """

    def __init__(self, num_pages: int) -> None:
        # Starts are <= num_pages and ends <= num_pages + 1, so a start fits below the stride.
        self._stride = num_pages + 2
        self._length_of: dict[int, int] = {}
        self._start_of_end: dict[int, int] = {}
        self._by_size = sorted_ints()
        self._insert(1, num_pages)

    def __len__(self) -> int:
        """Number of runs."""
        return len(self._length_of)

    def best_fit(self, num_pages: int) -> int | None:
        """Start of the smallest run of at least ``num_pages`` pages (the lowest-starting one
        among equal lengths), or ``None`` when no run is that long."""
        # bisect + index beats irange here: irange builds a chain of iterators per call.
        at = self._by_size.bisect_left(num_pages * self._stride)
        if at == len(self._by_size):
            return None
        return self._by_size[at] % self._stride

    def longest_first(self, num_pages: int) -> list[tuple[int, int]]:
        """``(start, length)`` of the longest runs (lower start first among equal lengths),
        as few as cover ``num_pages`` pages; work proportional to the runs returned.

        The caller ensures ``num_pages`` pages are free.
        """
        runs: list[tuple[int, int]] = []
        covered, below = 0, None  # keys of runs not yet visited are < below
        while covered < num_pages:
            longest = self._by_size.irange(maximum=below, inclusive=(True, False), reverse=True)
            top = next(longest, None)
            assert top is not None, f"free-run index holds {covered} pages, asked for {num_pages}"
            length = top // self._stride
            # ``top`` is the highest start among the longest runs left; visit them lowest first.
            for key in self._by_size.irange(length * self._stride, top):
                runs.append((key % self._stride, length))
                covered += length
                if covered >= num_pages:
                    break
            below = length * self._stride
        return runs

    def take(self, start: int, num_pages: int) -> None:
        """Remove the lowest ``num_pages`` pages of the run that starts at ``start``."""
        length = self._length_of.pop(start)
        self._by_size.remove(length * self._stride + start)
        end = start + length
        if num_pages < length:
            rest = start + num_pages
            self._length_of[rest] = end - rest
            self._start_of_end[end] = rest
            self._by_size.add((end - rest) * self._stride + rest)
        else:
            del self._start_of_end[end]

    def add(self, start: int, length: int) -> None:
        """Add pages ``[start, start + length)`` (none of them in a run), merged with the runs
        that touch them."""
        end = start + length
        below = self._start_of_end.pop(start, None)
        if below is not None:
            self._by_size.remove((start - below) * self._stride + below)
            del self._length_of[below]
            start = below
        above = self._length_of.pop(end, None)
        if above is not None:
            self._by_size.remove(above * self._stride + end)
            del self._start_of_end[end + above]
            end += above
        self._insert(start, end - start)

    def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)``, int64 arrays of shape ``[num_runs]``, ascending by start."""
        keys = np.fromiter(self._by_size, dtype=np.int64, count=len(self._by_size))
        starts, lengths = keys % self._stride, keys // self._stride
        order = np.argsort(starts, kind="stable")
        return starts[order], lengths[order]

    def check_integrity(self, name: str) -> None:
        """Raise ``RuntimeError`` unless the three views of the runs agree and no two runs
        touch or overlap."""
        by_end = {start + length: start for start, length in self._length_of.items()}
        by_size = {key % self._stride: key // self._stride for key in self._by_size}
        if by_end != self._start_of_end or by_size != self._length_of:
            raise RuntimeError(f"pool '{name}': free-run index views disagree")
        starts, lengths = self.as_arrays()
        if (lengths < 1).any() or (starts[1:] <= starts[:-1] + lengths[:-1]).any():
            raise RuntimeError(f"pool '{name}': free-run index has empty, touching or "
                               f"overlapping runs")

    def _insert(self, start: int, length: int) -> None:
        self._length_of[start] = length
        self._start_of_end[start + length] = start
        self._by_size.add(length * self._stride + start)
