"""A large allocation from a fragmented pool, computed from the free map in bulk.

:class:`~hicache.pools.free_runs.FreeRuns` answers an allocation by touching each run it
takes: a dict deletion, a list operation and a share of a sort per run, about a quarter of a
microsecond each. A 32k-token load into a pool whose free pages are two thousand scattered
holes takes two thousand runs, half a millisecond of the scheduler thread. Here the same
choice (the lowest pages of the fewest longest runs, lower start first among equal lengths)
is made with a few vectorised passes over the free map, and the run index is rebuilt from
the runs that stay free, at a cost per remaining run, which is the smaller side when a
request takes most of the runs. :func:`take_longest_runs` picks the side
(:func:`bulk_pays`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .page_runs import FEW_RUNS, pages_of_runs, runs_of_sorted

if TYPE_CHECKING:  # free_runs imports this module
    from .free_runs import FreeRuns

BULK_MIN_RUNS = 64
"""Fewer runs taken than this go through the run index one by one (the bulk path's fixed
cost, a few numpy calls, is larger)."""

PAGES_PER_RUN_COST = 256
"""Pages of the free map scanned for the cost of updating one run in the index (measured:
a scan costs about a nanosecond a page, an index update about a quarter microsecond)."""


def bulk_pays(runs_taken: int, runs_left: int, num_pages: int) -> bool:
    """True when taking ``runs_taken`` runs one by one costs more than scanning a free map of
    ``num_pages`` pages and rebuilding the index of the ``runs_left`` that stay."""
    return runs_taken >= BULK_MIN_RUNS and \
        runs_taken > runs_left + num_pages // PAGES_PER_RUN_COST


def runs_to_take(lengths: list[int], counts: dict[int, int], num_pages: int) -> int:
    """How many runs the longest-first take of ``num_pages`` (free, and more than any run
    holds) draws on, from the lengths some run has (ascending) and their run counts."""
    covered = taken = 0
    for length in reversed(lengths):
        count = min(counts[length], -(-(num_pages - covered) // length))
        taken += count
        covered += count * length
        if covered >= num_pages:
            break
    return taken


def take_longest_from_map(is_free: np.ndarray, num_pages: int
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The lowest ``num_pages`` pages of the fewest longest free runs of ``is_free`` (lower
    start first among equal lengths): the surplus, fewer pages than the shortest run chosen,
    is the top of the highest-starting chosen run, which stays free.

    The caller ensures ``num_pages`` (>= 1) pages are free; ``is_free`` is not changed.

    Returns:
        ``(pages, starts, lengths)``: the pages taken, ascending, and the runs that stay
        free (in no particular order); int64.
    """
    starts, lengths = runs_of_sorted(np.flatnonzero(is_free))
    order = np.lexsort((starts, -lengths))
    covered = np.cumsum(lengths[order])
    last = int(np.searchsorted(covered, num_pages))
    chosen = np.sort(order[: last + 1])  # ascending starts: the runs are in page order
    kept = np.ones(starts.size, dtype=bool)
    kept[chosen] = False
    left_starts, left_lengths = starts[kept], lengths[kept]
    taken_starts, taken_lengths = starts[chosen], lengths[chosen]  # new arrays
    surplus = int(covered[last]) - num_pages
    if surplus:  # the highest-starting chosen run keeps its top ``surplus`` pages free
        taken_lengths[-1] -= surplus
        left_starts = np.append(left_starts, taken_starts[-1] + taken_lengths[-1])
        left_lengths = np.append(left_lengths, surplus)
    offsets = np.cumsum(taken_lengths) - taken_lengths
    pages = np.repeat(taken_starts - offsets, taken_lengths) + \
        np.arange(num_pages, dtype=np.int64)
    return pages, left_starts, left_lengths


def index_of_runs(starts: np.ndarray, lengths: np.ndarray
                  ) -> tuple[dict[int, int], dict[int, int], list[int], dict[int, list[int]],
                             dict[int, int]]:
    """The views of :class:`~hicache.pools.free_runs.FreeRuns` over disjoint, non-touching
    runs ``(starts, lengths)`` (any order): by start, by end, the lengths ascending, each
    length's starts (ascending: a heap) and count. Built in bulk: C-level dict and list
    construction, a Python step per distinct length only."""
    order = np.lexsort((starts, lengths))
    starts, lengths = starts[order], lengths[order]
    start_list = starts.tolist()
    length_of = dict(zip(start_list, lengths.tolist(), strict=True))
    start_of_end = dict(zip((starts + lengths).tolist(), start_list, strict=True))
    if not start_list:
        return length_of, start_of_end, [], {}, {}
    edges = [0, *(np.flatnonzero(lengths[1:] != lengths[:-1]) + 1).tolist(), len(start_list)]
    classes = [int(lengths[edge]) for edge in edges[:-1]]
    by_length = {length: start_list[a:b]
                 for length, a, b in zip(classes, edges[:-1], edges[1:], strict=True)}
    counts = {length: len(group) for length, group in by_length.items()}
    return length_of, start_of_end, classes, by_length, counts


def take_longest_runs(index: FreeRuns, is_free: np.ndarray, num_pages: int, pool_pages: int
                      ) -> list[tuple[int, int]] | np.ndarray:
    """Allocate ``num_pages`` pages from the longest runs of a pool of ``pool_pages`` pages
    whose free runs are ``index`` and free map ``is_free`` (both updated; the caller counts
    the pages taken) when no run holds them all: the lowest ``num_pages`` pages of the
    fewest longest runs that cover them. Returns ``(first page, length)`` runs ascending for
    the few runs of most allocations (a slice store each), page ids (ascending, int64) for
    the many of a fragmented pool (one indexed store). When the runs taken outnumber those
    left (a large load into scattered holes) the choice is made from the free map in bulk,
    the run index rebuilt from what stays."""
    taken = index.runs_to_take(num_pages)
    if bulk_pays(taken, len(index) - taken, pool_pages):
        pages, left_starts, left_lengths = take_longest_from_map(is_free, num_pages)
        index.replace(left_starts, left_lengths)
        is_free[pages] = False
        return pages
    starts, lengths = index.take_longest(num_pages)
    if len(starts) <= FEW_RUNS:
        runs = sorted(zip(starts, lengths, strict=True))
        for start, length in runs:
            is_free[start:start + length] = False
        return runs
    pages = pages_of_runs(starts, lengths)
    is_free[pages] = False
    return pages
