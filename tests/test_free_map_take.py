"""The bulk take of a large allocation from a fragmented pool (hicache.pools.free_map_take):
it counts the runs a longest-first take needs exactly, takes the same pages as the run
index would, leaves the same runs free, and is chosen by its stated cost model."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.pools.free_map_take import (
    BULK_MIN_RUNS,
    PAGES_PER_RUN_COST,
    bulk_pays,
    take_longest_from_map,
)
from hicache.pools.free_runs import FreeRuns
from hicache.pools.page_runs import runs_of_sorted


def index_of(is_free: np.ndarray) -> FreeRuns:
    runs = FreeRuns(len(is_free) - 1)
    runs.replace(*runs_of_sorted(np.flatnonzero(is_free)))
    return runs


@st.composite
def fragmented(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """A free map of pages 0..n (page 0 never free) with at least two runs, and a take of
    more pages than its longest run holds, at most all that is free."""
    cells = draw(st.lists(st.booleans(), min_size=4, max_size=120))
    is_free = np.array([False, *cells], dtype=bool)
    starts, lengths = runs_of_sorted(np.flatnonzero(is_free))
    if starts.size < 2:
        is_free[1:] = np.arange(len(cells)) % 3 != 2
        starts, lengths = runs_of_sorted(np.flatnonzero(is_free))
    num_pages = draw(st.integers(int(lengths.max()) + 1, int(lengths.sum())))
    return is_free, num_pages


@settings(max_examples=300, deadline=None)
@given(fragmented())
def test_runs_counted_before_a_take_are_the_runs_it_takes(case: tuple[np.ndarray, int]
                                                          ) -> None:
    is_free, num_pages = case
    runs = index_of(is_free)
    counted = runs.runs_to_take(num_pages)
    before = runs.as_arrays()
    assert all(np.array_equal(a, b) for a, b in zip(before, runs.as_arrays(), strict=True))
    starts, lengths = runs.take_longest(num_pages)
    assert counted == len(starts)
    assert sum(lengths) == num_pages


@settings(max_examples=300, deadline=None)
@given(fragmented())
def test_the_bulk_take_matches_the_run_index(case: tuple[np.ndarray, int]) -> None:
    """Same pages, same runs left free; the map itself is not changed."""
    is_free, num_pages = case
    kept = is_free.copy()
    pages, left_starts, left_lengths = take_longest_from_map(is_free, num_pages)
    assert np.array_equal(is_free, kept)
    runs = index_of(is_free)
    starts, lengths = runs.take_longest(num_pages)
    expected = sorted(p for s, n in zip(starts, lengths, strict=True) for p in range(s, s + n))
    assert pages.tolist() == expected
    assert pages.dtype == np.int64
    left = runs.as_arrays()
    assert sorted(zip(left_starts.tolist(), left_lengths.tolist(), strict=True)) == \
        sorted(zip(left[0].tolist(), left[1].tolist(), strict=True))
    after = is_free.copy()
    after[pages] = False
    assert runs_of_sorted(np.flatnonzero(after))[0].tolist() == sorted(left_starts.tolist())


def test_the_bulk_path_pays_past_its_fixed_cost_and_the_index_it_rebuilds() -> None:
    """Fewer than BULK_MIN_RUNS runs taken: never. Then: when the runs taken outnumber the
    runs left plus one per PAGES_PER_RUN_COST pages of the map."""
    assert (BULK_MIN_RUNS, PAGES_PER_RUN_COST) == (64, 256)
    assert not bulk_pays(63, 0, 0)
    assert bulk_pays(64, 0, 0)
    assert not bulk_pays(100, 100, 0)
    assert bulk_pays(101, 100, 0)
    assert not bulk_pays(101, 100, 256)
    assert bulk_pays(102, 100, 256)
    assert not bulk_pays(102, 100, 511 + 256)
    assert not bulk_pays(1000, 0, 1000 * 256)
    assert bulk_pays(1001, 0, 1000 * 256)
