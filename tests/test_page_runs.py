"""Runs of consecutive page ids (hicache.pools.page_runs) against a plain reference, on any
set of distinct pages: one page, one ascending run, pages out of order, few and many runs;
and runs expanded back into pages and slots."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_free_runs_moves import runs_of_pages

from hicache.pools.page_runs import (
    FEW_RUNS,
    expand_runs,
    pages_of_runs,
    runs_of,
    runs_of_sorted,
)

distinct_pages = st.lists(st.integers(1, 400), min_size=1, max_size=120, unique=True)


@settings(max_examples=300, deadline=None)
@given(distinct_pages, st.sampled_from(["given", "ascending", "descending"]))
def test_runs_of_any_distinct_pages(pages: list[int], order: str) -> None:
    if order != "given":
        pages = sorted(pages, reverse=order == "descending")
    starts, lengths = runs_of(np.array(pages, dtype=np.int64))
    assert sorted(zip(starts, lengths, strict=True)) == runs_of_pages(pages)
    assert all(type(x) is int for x in [*starts, *lengths])


def test_the_shapes_each_path_takes() -> None:
    """One page, one ascending run, a few runs, more than FEW_RUNS runs (the bulk path)."""
    assert runs_of(np.array([7])) == ([7], [1])
    assert runs_of(np.array([3, 4, 5, 6])) == ([3], [4])
    assert runs_of(np.array([9, 3, 4, 10])) == ([3, 9], [2, 2])
    many = np.arange(1, 4 * (FEW_RUNS + 2), 2)[::-1]  # one-page runs, descending
    starts, lengths = runs_of(many)
    assert starts == sorted(many.tolist()) and lengths == [1] * many.size


@settings(max_examples=200, deadline=None)
@given(distinct_pages)
def test_sorted_runs_and_their_expansion_round_trip(pages: list[int]) -> None:
    ascending = np.array(sorted(pages), dtype=np.int64)
    starts, lengths = runs_of_sorted(ascending)
    assert list(zip(starts.tolist(), lengths.tolist(), strict=True)) == \
        runs_of_pages(pages)
    assert pages_of_runs(starts[::-1].tolist(), lengths[::-1].tolist()).tolist() == \
        ascending.tolist()
    runs = list(zip(starts.tolist(), lengths.tolist(), strict=True))
    assert expand_runs(runs, 1).tolist() == ascending.tolist()
    slots = expand_runs(runs, 4)
    assert slots.tolist() == [p * 4 + i for p in ascending.tolist() for i in range(4)]
    assert expand_runs(ascending, 4).tolist() == slots.tolist()
    copy = expand_runs(ascending, 1)
    copy[0] = -1
    assert ascending[0] != -1


def test_nothing_expands_to_nothing() -> None:
    assert expand_runs([], 4).dtype == np.int64 and expand_runs([], 4).size == 0
    empty = np.empty(0, dtype=np.int64)
    assert all(part.size == 0 for part in runs_of_sorted(empty))
