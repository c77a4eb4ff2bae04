"""The allocator's conservation checks (``pools.snapshot``) find every kind of damage they
name: given a consistent state they pass; given one with a single thing wrong they raise,
naming it (CPU, states built by hand: the allocator never makes them)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.pools.snapshot import AllocatorSnapshot, check_run_views, scan_runs

# pages 0..7 of a 7-page pool: page 0 reserved (not counted), pages 2-3 and 5 free
FREE = np.array([False, False, True, True, False, True, False, False])


def snapshot(is_free: np.ndarray = FREE, num_free: int = 3,
             starts: list[int] | None = None, lengths: list[int] | None = None
             ) -> AllocatorSnapshot:
    scanned_starts, scanned_lengths = scan_runs(is_free)
    return AllocatorSnapshot(
        is_free, num_free,
        scanned_starts if starts is None else np.array(starts, dtype=np.int64),
        scanned_lengths if lengths is None else np.array(lengths, dtype=np.int64))


def test_a_consistent_snapshot_passes() -> None:
    snapshot().verify("full", 7)
    first_free = np.array([False, True, False, False, True, False])  # page 1 free
    snapshot(first_free, num_free=2).verify("full", 5)
    starts, lengths = scan_runs(FREE)
    assert starts.tolist() == [2, 5] and lengths.tolist() == [2, 1]


@pytest.mark.parametrize(("broken", "message"), [
    (snapshot(is_free=np.array([True, False, True, True, False, True, False, False]),
              num_free=4), "reserved page 0 is marked free"),
    (snapshot(num_free=4), "free count 4 pages != 3 pages marked free"),
    (snapshot(starts=[2, 5], lengths=[2, 2]), r"the free-run index \(2 runs\) differs"),
    (snapshot(starts=[2, 4], lengths=[2, 1]), r"the free-run index \(2 runs\) differs"),
    (snapshot(starts=[2], lengths=[2]), r"the free-run index \(1 runs\) differs"),
])
def test_each_damage_is_named(broken: AllocatorSnapshot, message: str) -> None:
    with pytest.raises(RuntimeError, match=f"^pool 'full': {message}"):
        broken.verify("full", 7)


def test_a_pool_of_another_size_does_not_add_up() -> None:
    with pytest.raises(RuntimeError, match=r"free 3 \+ used 4 pages != capacity 8 pages"):
        snapshot().verify("full", 8)


def views_of(length_of: dict[int, int]) -> tuple[dict[int, int], dict[int, int], list[int],
                                                  dict[int, list[int]], dict[int, int]]:
    """A free-run index's views that agree with each other for ``length_of``."""
    counts: dict[int, int] = {}
    starts: dict[int, list[int]] = {}
    for start, length in length_of.items():
        counts[length] = counts.get(length, 0) + 1
        starts.setdefault(length, []).append(start)
    return (length_of, {s + n: s for s, n in length_of.items()}, sorted(counts), starts,
            counts)


def test_runs_apart_pass() -> None:
    check_run_views("full", *views_of({2: 2, 5: 1, 9: 3}))


@pytest.mark.parametrize("length_of", [
    {2: 2, 4: 1},  # touching: one run, recorded as two
    {4: 1, 2: 2},  # the same, listed in another order
    {2: 3, 4: 1},  # overlapping
    {2: 2, 6: 0},  # empty
])
def test_touching_overlapping_or_empty_runs_are_found(length_of: dict[int, int]) -> None:
    with pytest.raises(RuntimeError, match=r"^pool 'full': free-run index has empty, touching "
                                           r"or overlapping runs$"):
        check_run_views("full", *views_of(length_of))


def test_views_that_disagree_are_found() -> None:
    length_of, by_end, lengths, starts, counts = views_of({2: 2, 5: 1})
    with pytest.raises(RuntimeError, match="views disagree"):
        check_run_views("full", length_of, by_end, lengths, starts, {2: 1, 1: 2})
    starts[1] = []
    with pytest.raises(RuntimeError, match="free run at page 5 is missing from the index of "
                                           "runs of 1 pages"):
        check_run_views("full", length_of, by_end, lengths, starts, counts)
