"""PageAllocator's free-run index against a scan-based model of its placement rule (CPU)."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.pools import IndexSpace, Indices, PageAllocator
from hicache.pools.free_map_take import bulk_pays


class ScanModel:
    """The placement rule over a plain list of free flags, scanning every page per call."""

    def __init__(self, num_pages: int) -> None:
        self.is_free = [False] + [True] * num_pages  # page 0 is reserved

    def runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every run of free pages, lowest first."""
        runs: list[tuple[int, int]] = []
        for page, free in enumerate(self.is_free):
            if free and runs and sum(runs[-1]) == page:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            elif free:
                runs.append((page, 1))
        return runs

    def alloc(self, num_pages: int) -> list[int] | None:
        """The smallest run that holds the request (lowest among equals), its first pages;
        else the lowest pages of the fewest longest runs (lower start first among equals)."""
        if num_pages > sum(self.is_free):
            return None
        runs = self.runs()
        fitting = [run for run in runs if run[1] >= num_pages]
        if fitting:
            start = min(fitting, key=lambda run: run[1])[0]
            pages = list(range(start, start + num_pages))
        else:
            taken: list[int] = []
            for start, length in sorted(runs, key=lambda run: -run[1]):
                if len(taken) >= num_pages:
                    break
                taken += range(start, start + length)
            pages = sorted(taken)[:num_pages]
        for page in pages:
            self.is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            self.is_free[page] = True


def _slots(pages: list[int], page_size: int) -> list[int]:
    return [p * page_size + o for p in pages for o in range(page_size)]


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 64), page_size=st.integers(1, 4), data=st.data())
def test_allocator_matches_the_scan_model(num_pages: int, page_size: int,
                                          data: st.DataObject) -> None:
    """Random allocs and scattered, unordered frees give the model's pages, counts and
    runs."""
    _model_steps(num_pages, page_size, data)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 64), page_size=st.integers(1, 4), data=st.data())
def test_allocator_from_the_free_map_matches_the_scan_model(num_pages: int, page_size: int,
                                                            data: st.DataObject) -> None:
    """The same with every allocation that no single run holds chosen from the free map in
    bulk and the run index rebuilt from the runs left (the path of large loads into
    scattered holes, which small pools never reach by cost)."""
    with mock.patch("hicache.pools.free_map_take.bulk_pays", lambda *_: True):
        _model_steps(num_pages, page_size, data)


def _model_steps(num_pages: int, page_size: int, data: st.DataObject) -> None:
    allocator = PageAllocator(num_pages, page_size, IndexSpace.HOST_FULL, "host")
    model = ScanModel(num_pages)
    used: list[int] = []
    for _ in range(data.draw(st.integers(0, 40), label="steps")):
        if not used or data.draw(st.booleans(), label="alloc"):
            want = data.draw(st.integers(0, num_pages + 1), label="num_pages")
            if data.draw(st.booleans(), label="try_alloc_pages"):
                got_pages = allocator.try_alloc_pages(want * page_size)
                got = None if got_pages is None else got_pages[0]
            else:
                got_pages, got = None, allocator.try_alloc(want * page_size)
            expected = model.alloc(want)
            assert (got is None) == (expected is None)
            if got is not None and expected is not None:
                assert got.tensor.tolist() == _slots(expected, page_size)
                if got_pages is not None:  # the page ids handed over are the slots' pages
                    assert got_pages[1].tolist() == expected
                used += expected
        else:
            chosen = data.draw(st.lists(st.sampled_from(used), min_size=1, unique=True),
                               label="free")
            allocator.free(Indices(torch.tensor(_slots(chosen, page_size)),
                                   IndexSpace.HOST_FULL))
            model.free(chosen)
            used = [page for page in used if page not in chosen]
        starts, lengths = allocator.free_runs()
        assert list(zip(starts.tolist(), lengths.tolist(), strict=True)) == model.runs()
        assert allocator.num_free_tokens == sum(model.is_free) * page_size
        assert sorted(allocator.used_pages().tolist()) == sorted(used)
        allocator.check_integrity()



def test_long_churn_keeps_the_model_and_bounded_heaps() -> None:
    """Thousands of small allocs and frees (many runs of equal length leaving and coming
    back, so heaps hold stale entries): the model's answers, and no heap grows beyond twice
    its live runs plus slack."""
    rng = random.Random(7)
    allocator = PageAllocator(300, 2, IndexSpace.DEVICE_FULL, "full")
    model = ScanModel(300)
    used: list[list[int]] = []
    for step in range(3000):
        if used and (rng.random() < 0.5 or allocator.num_free_tokens < 10):
            pages = used.pop(rng.randrange(len(used)))
            allocator.free(Indices(torch.tensor(_slots(pages, 2)), IndexSpace.DEVICE_FULL))
            model.free(pages)
        else:
            want = rng.choice([1, 1, 1, 2, 3, 5])
            got, expected = allocator.try_alloc(want * 2), model.alloc(want)
            assert (got is None) == (expected is None)
            if got is not None and expected is not None:
                assert got.tensor.tolist() == _slots(expected, 2), step
                used.append(expected)
        runs = allocator._runs
        for length, heap in runs._starts.items():
            assert len(heap) <= 2 * runs._counts[length] + 17
    starts, lengths = allocator.free_runs()
    assert list(zip(starts.tolist(), lengths.tolist(), strict=True)) == model.runs()
    allocator.check_integrity()


@pytest.mark.parametrize("from_map", [None, True, False])
def test_fragmented_pool_bulk_allocs_and_frees_keep_the_model(from_map: bool | None) -> None:
    """Allocations drawing on hundreds of runs and frees of hundreds of scattered pages (the
    run index's bulk paths: whole length classes taken, isolated runs joined per class,
    touching ones merged) give the model's pages and runs at every step, with the index
    consistent and its heaps bounded by the pool's size. ``from_map``: every allocation
    from many runs chosen from the free map in bulk with the index rebuilt (True), none
    (False), or as the cost rule picks (None: both happen)."""
    chose: list[bool] = []

    def pick(*args: int) -> bool:
        chose.append(bulk_pays(*args) if from_map is None else from_map)
        return chose[-1]

    with mock.patch("hicache.pools.free_map_take.bulk_pays", pick):
        _fragmented_churn()
    assert (True in chose) is (from_map is not False) and (False in chose) is (not from_map)


def _fragmented_churn() -> None:
    rng = random.Random(11)
    num_pages = 900
    allocator = PageAllocator(num_pages, 2, IndexSpace.DEVICE_FULL, "full")
    model = ScanModel(num_pages)
    used: set[int] = set()
    bulk_allocs = bulk_frees = 0
    for step in range(300):
        free_pages = num_pages - len(used)
        if used and (rng.random() < 0.5 or free_pages < 4):
            share = rng.choice([0.02, 0.3, 0.6, 1.0])
            chosen = rng.sample(sorted(used), max(1, int(len(used) * share)))
            bulk_frees += len(chosen) > 100
            allocator.free(Indices(torch.tensor(_slots(chosen, 2)), IndexSpace.DEVICE_FULL))
            model.free(chosen)
            used -= set(chosen)
        else:
            want = rng.choice([1, 3, free_pages // 2, free_pages - 1, free_pages, free_pages + 1])
            runs_before = len(model.runs())
            got, expected = allocator.try_alloc(want * 2), model.alloc(want)
            assert (got is None) == (expected is None), step
            if got is not None and expected is not None:
                assert got.tensor.tolist() == _slots(expected, 2), step
                used |= set(expected)
                bulk_allocs += runs_before > 100 and want > 100
        starts, lengths = allocator.free_runs()
        assert list(zip(starts.tolist(), lengths.tolist(), strict=True)) == model.runs(), step
        assert allocator.num_free_tokens == sum(model.is_free) * 2
        allocator.check_integrity()
        heaps = allocator._runs._starts  # stale entries stay bounded by the pool, not the steps
        assert sum(map(len, heaps.values())) <= 2 * num_pages + 17 * len(heaps)
    assert bulk_allocs >= 10 and bulk_frees >= 10, (bulk_allocs, bulk_frees)


def test_try_alloc_pages_over_many_runs_hands_over_the_page_ids() -> None:
    """An allocation over hundreds of one-page runs: slots page after page, ascending, and
    page ids equal to the slots' pages, in a new array the allocator does not keep."""
    allocator = PageAllocator(400, 4, IndexSpace.DEVICE_FULL, "full")
    assert allocator.try_alloc(allocator.capacity_tokens) is not None
    odd = list(range(1, 401, 2))
    allocator.free(Indices(torch.tensor(_slots(odd, 4)), IndexSpace.DEVICE_FULL))
    got = allocator.try_alloc_pages(150 * 4)
    assert got is not None
    slots, page_ids = got
    assert slots.tensor.tolist() == _slots(odd[:150], 4)
    assert page_ids.tolist() == odd[:150]
    page_ids[:] = 0  # the caller's to change
    allocator.check_integrity()
    allocator.free(slots)
    assert allocator.num_free_tokens == 200 * 4
    allocator.check_integrity()
