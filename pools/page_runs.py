"""Runs of consecutive page ids: found among a set of pages (what a free returns to the
run index) and expanded back into page ids or slots (what an allocation hands out).

Both sides choose per size: a few runs go through Python lists (numpy's wrappers cost more
than the arithmetic there), many (a fragmented pool, thousands of one-page runs) through
vectorised numpy.
"""

from __future__ import annotations

import numpy as np

# Up to this many runs an allocation or a free handles runs one by one (a slice store, an
# index update each); beyond, in bulk (one indexed store, whole classes of the run index).
FEW_RUNS = 16


def expand_runs(runs: list[tuple[int, int]] | np.ndarray, scale: int) -> np.ndarray:
    """Every page of the ``(first page, length)`` runs, run after run, or of the page ids
    ``runs`` (a new array either way), times ``scale`` slots (1: page ids; the page size:
    their slots), int64."""
    if isinstance(runs, np.ndarray):
        if scale == 1:
            return runs.copy()
        return (runs[:, None] * scale + np.arange(scale, dtype=np.int64)[None, :]).reshape(-1)
    if not runs:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(start * scale, (start + length) * scale, dtype=np.int64)
                           for start, length in runs])


def pages_of_runs(starts: list[int], lengths: list[int]) -> np.ndarray:
    """Every page of the runs ``(starts[i], lengths[i])`` (disjoint, in any order),
    ascending: int64, vectorised (for many runs)."""
    first = np.array(starts, dtype=np.int64)
    size = np.array(lengths, dtype=np.int64)
    order = np.argsort(first)
    first, size = first[order], size[order]
    return np.repeat(first - (np.cumsum(size) - size), size) + \
        np.arange(int(size.sum()), dtype=np.int64)


def runs_of(pages: np.ndarray) -> tuple[list[int], list[int]]:
    """``(starts, lengths)`` of the runs of consecutive pages among distinct ``pages``
    (sorted here unless they ascend; no numpy wrapper functions, whose Python layers cost
    more than the arithmetic at these sizes). The sort is numpy's stable one (timsort for
    int64), which takes the ascending runs a free's pages come in (each tree node's pages,
    node after node) as they are: for the 6272 pages of a 10% eviction of a 1M-token tree,
    33 us against 153 for the default sort (which took 131 us even on sorted pages), and
    about equal on random pages."""
    if pages.size == 1:
        return [pages.item()], [1]
    steps = pages[1:] - pages[:-1]
    (breaks,) = (steps != 1).nonzero()
    if not breaks.size:  # one ascending run
        return [int(pages[0])], [int(pages.size)]
    if steps.min() < 0:  # not ascending (an allocation's pages are): sort, find them again
        pages = np.sort(pages, kind="stable")  # timsort: the pages come in ascending runs
        (breaks,) = (pages[1:] - pages[:-1] != 1).nonzero()
    if breaks.size < FEW_RUNS:
        starts = [int(pages[0]), *pages[breaks + 1].tolist()]
        ends = [*pages[breaks].tolist(), int(pages[-1])]
        return starts, [end - start + 1 for start, end in zip(starts, ends, strict=True)]
    first_pages, lengths = _bounds(pages, breaks)
    return first_pages.tolist(), lengths.tolist()


def runs_of_sorted(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the runs of consecutive pages among ascending, distinct
    ``pages`` (a free map's ``flatnonzero``), as int64 arrays (vectorised; none for none)."""
    if not pages.size:
        return pages, pages
    return _bounds(pages, (pages[1:] - pages[:-1] != 1).nonzero()[0])


def _bounds(pages: np.ndarray, breaks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First pages and lengths of the runs of ascending ``pages`` that end at ``breaks``
    (positions of each run's last page but the final one)."""
    firsts = np.empty(breaks.size + 1, dtype=np.intp)
    firsts[0], firsts[1:] = 0, breaks + 1
    lasts = np.empty_like(firsts)
    lasts[:-1], lasts[-1] = breaks, pages.size - 1
    first_pages = pages[firsts]
    return first_pages, pages[lasts] - first_pages + 1
