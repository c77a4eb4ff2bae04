"""An allocator's state at one moment, and the conservation checks run on it later.

``PageAllocator.integrity_snapshot`` copies a few arrays under the caller's lock;
:meth:`AllocatorSnapshot.verify` scans them with no lock held (bounded integrity slices).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AllocatorSnapshot:
    """An allocator's state at one moment (see :meth:`PageAllocator.integrity_snapshot`)."""

    is_free: np.ndarray
    num_free_pages: int
    run_starts: np.ndarray
    run_lengths: np.ndarray

    def verify(self, name: str, num_pages: int) -> None:
        """Raise ``RuntimeError`` unless page 0 is reserved, the free count matches the free
        map, free + used == ``num_pages`` and the free-run index lists exactly the runs of
        the free map (a scan of it)."""
        is_free = self.is_free
        num_free = int(is_free.sum())
        if is_free[0]:
            raise RuntimeError(f"pool '{name}': reserved page 0 is marked free")
        if num_free != self.num_free_pages:
            raise RuntimeError(
                f"pool '{name}': free count {self.num_free_pages} pages != "
                f"{num_free} pages marked free"
            )
        num_used = int(used_pages_of(is_free).size)
        if num_free + num_used != num_pages:
            raise RuntimeError(
                f"pool '{name}': free {num_free} + used {num_used} pages != "
                f"capacity {num_pages} pages"
            )
        scanned_starts, scanned_lengths = scan_runs(is_free)
        if not (
            np.array_equal(self.run_starts, scanned_starts)
            and np.array_equal(self.run_lengths, scanned_lengths)
        ):
            raise RuntimeError(
                f"pool '{name}': the free-run index ({self.run_starts.size} runs) "
                f"differs from the free map ({scanned_starts.size} runs)"
            )


def used_pages_of(free_map: np.ndarray) -> np.ndarray:
    """Ids of the allocated pages of a free map (page 0, the padding page, excluded)."""
    used = np.flatnonzero(~free_map)
    return used[used != 0]


def scan_runs(is_free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the runs of ``True`` in ``is_free``, by a pass over it."""
    padded = np.concatenate(([False], is_free, [False]))
    edges = np.flatnonzero(np.diff(padded.astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    return starts, ends - starts


def check_run_views(name: str, length_of: dict[int, int], start_of_end: dict[int, int],
                    lengths: list[int], starts: dict[int, list[int]],
                    counts: dict[int, int]) -> None:
    """Raise ``RuntimeError`` unless the views of a free-run index
    (:class:`~hicache.pools.free_runs.FreeRuns`: runs by start, by end, the lengths some
    run has, the heap of starts and the count of runs per length) agree and no two runs
    touch or overlap."""
    by_end = {start + length: start for start, length in length_of.items()}
    by_length: dict[int, int] = {}
    for length in length_of.values():
        by_length[length] = by_length.get(length, 0) + 1
    if (by_end != start_of_end or by_length != counts or lengths != sorted(by_length)
            or starts.keys() != by_length.keys()):
        raise RuntimeError(f"pool '{name}': free-run index views disagree")
    for start, length in length_of.items():
        if start not in starts[length]:
            raise RuntimeError(f"pool '{name}': free run at page {start} is missing from "
                               f"the index of runs of {length} pages")
    first, size = runs_as_arrays(length_of)
    if (size < 1).any() or (first[1:] <= first[:-1] + size[:-1]).any():
        raise RuntimeError(f"pool '{name}': free-run index has empty, touching or "
                           f"overlapping runs")


def runs_as_arrays(length_of: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the runs ``length_of`` maps (start to length): int64 arrays
    of shape ``[num_runs]``, ascending by start."""
    count = len(length_of)
    starts = np.fromiter(length_of.keys(), dtype=np.int64, count=count)
    lengths = np.fromiter(length_of.values(), dtype=np.int64, count=count)
    order = np.argsort(starts, kind="stable")
    return starts[order], lengths[order]
