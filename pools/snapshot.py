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
