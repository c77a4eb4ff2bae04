"""FreeRuns: a run that shrinks or grows keeps every view of the index right, whether its
length class is relabelled in place or moved (CPU)."""

from __future__ import annotations

import random

import pytest

from hicache.pools.free_runs import FreeRuns


def runs_of_pages(free: set[int] | list[int]) -> list[tuple[int, int]]:
    """Maximal runs of the ``free`` pages, lowest first."""
    runs: list[tuple[int, int]] = []
    for page in sorted(free):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def _check(index: FreeRuns, free: set[int]) -> None:
    index.check_integrity("test")
    starts, lengths = index.as_arrays()
    assert list(zip(starts.tolist(), lengths.tolist(), strict=True)) == runs_of_pages(free)


def test_a_lone_run_shrinks_and_grows_in_place() -> None:
    """One run taken from and given back page by page stays the index's only run."""
    index = FreeRuns(10)
    for page in range(1, 5):
        index.take(page, 1)
        _check(index, set(range(page + 1, 11)))
    for page in range(4, 0, -1):
        index.add(page, 1)
        _check(index, set(range(page, 11)))
    assert index.best_fit(10) == 1


def test_a_run_passing_another_length_moves_its_class() -> None:
    """A run that shrinks past the length of another run leaves the in-place path."""
    index = FreeRuns(20)
    index.take(1, 15)  # free: 16..20 (5 pages)
    index.add(1, 3)  # free: 1..3 and 16..20
    index.take(16, 3)  # 5 -> 2 pages: below the run of 3
    _check(index, {1, 2, 3, 19, 20})
    assert index.best_fit(2) == 19 and index.best_fit(3) == 1
    index.add(4, 2)  # 3 -> 5 pages, grown up from below
    index.add(16, 3)  # 2 -> 5: the class of 5 exists
    _check(index, {1, 2, 3, 4, 5, 16, 17, 18, 19, 20})
    assert index.best_fit(5) == 1


@pytest.mark.parametrize("seed", range(4))
def test_random_takes_and_adds_keep_the_index(seed: int) -> None:
    """Random allocations (best fit) and frees agree with a model set after every step."""
    rng = random.Random(seed)
    index, free = FreeRuns(64), set(range(1, 65))
    for _ in range(400):
        if free and rng.random() < 0.55:
            want = rng.choice([1, 1, 2, 3, 5])
            start = index.best_fit(want)
            if start is None:
                continue
            index.take(start, want)
            free -= set(range(start, start + want))
        else:
            used = set(range(1, 65)) - free
            if not used:
                continue
            page = rng.choice(sorted(used))
            length = 1
            while page + length in used and rng.random() < 0.5:
                length += 1
            index.add(page, length)
            free |= set(range(page, page + length))
        _check(index, free)
