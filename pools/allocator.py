"""Page allocator shared by every pool (device full, device SWA, host full, host SWA).

Bookkeeping only: plain CPU data, no stream, no device tensor. Requests are placed in runs
of consecutive pages wherever the free list allows (see ``try_alloc``), so copies of a page
set are long (the copy engine needs contiguous host runs). Page 0 is reserved for padding
and is never handed out.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import IndexSpace, Indices, check_indices, check_page_multiple

CPU = torch.device("cpu")


class PageAllocator:
    """Hands out whole pages of slots of one pool.

    Args:
        num_pages: usable pages (page 0 comes on top of these and is reserved).
        page_size: slots per page.
        space: the index space of the slots it hands out.
        name: pool name used in error messages.

    Slot indices are ``page * page_size + offset``; valid slots are ``[0, num_slots)`` with
    ``num_slots = (num_pages + 1) * page_size``.
    """

    def __init__(self, num_pages: int, page_size: int, space: IndexSpace, name: str) -> None:
        if num_pages < 1:
            raise ValueError(f"pool '{name}': needs at least one usable page, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"pool '{name}': page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.space = space
        self.name = name
        # is_free[p] for p in [0, num_pages]; page 0 is reserved and never free.
        self._is_free = np.ones(num_pages + 1, dtype=bool)
        self._is_free[0] = False
        self._num_free_pages = num_pages
        self._page_offsets = np.arange(page_size, dtype=np.int64)

    @property
    def num_slots(self) -> int:
        """Slots in the pool including the reserved page."""
        return (self.num_pages + 1) * self.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_tokens(self) -> int:
        return self._num_free_pages * self.page_size

    @property
    def num_used_tokens(self) -> int:
        return self.capacity_tokens - self.num_free_tokens

    def can_alloc(self, num_tokens: int) -> bool:
        return num_tokens <= self.num_free_tokens

    def try_alloc(self, num_tokens: int) -> Indices | None:
        """Allocate ``num_tokens`` slots (a page multiple), in runs of consecutive pages.

        Run-friendly: the smallest free run that holds the whole request is used (lowest
        first among equals); if no run is long enough, the longest runs are taken first, so
        a copy of the result needs as few contiguous pieces as the free list allows.

        Returns:
            int64 CPU :class:`Indices` of shape ``[num_tokens]`` in ascending slot order, or
            ``None`` when fewer than ``num_tokens`` slots are free (nothing allocated then).
        """
        check_page_multiple(num_tokens, self.page_size, f"alloc from pool '{self.name}'")
        num_pages = num_tokens // self.page_size
        if num_pages > self._num_free_pages:
            return None
        pages = self._pick_pages(num_pages)
        self._is_free[pages] = False
        self._num_free_pages -= num_pages
        return Indices(torch.from_numpy(self._slots_of(pages)), self.space)

    def free(self, indices: Indices) -> None:
        """Return whole pages to the pool.

        Raises:
            ValueError: the indices are not whole pages, name the reserved page, are out of
                range, repeat a page, or name a page that is not allocated (a double free or
                a slot this allocator never handed out). Nothing is freed then.
        """
        pages = self.pages_of(indices, op=f"free to pool '{self.name}'")
        if pages.size == 0:
            return
        not_allocated = pages[self._is_free[pages]]
        if not_allocated.size:
            slot = int(not_allocated[0]) * self.page_size
            raise ValueError(
                f"free to pool '{self.name}': slot {slot} (page {int(not_allocated[0])}) is not "
                f"allocated: a double free, or an index from another pool"
            )
        self._is_free[pages] = True
        self._num_free_pages += int(pages.size)

    def pages_of(self, indices: Indices, *, op: str) -> np.ndarray:
        """Page ids of slot ``indices`` that must be whole pages in order; raises otherwise."""
        tensor = check_indices(
            indices, space=self.space, pool_name=self.name, num_slots=self.num_slots,
            device=CPU, op=op,
        )
        slots = tensor.numpy().astype(np.int64, copy=False)
        if slots.size % self.page_size != 0:
            raise ValueError(
                f"{op}: {slots.size} slots is not a whole number of pages of {self.page_size}"
            )
        if slots.size == 0:
            return np.empty(0, dtype=np.int64)
        by_page = slots.reshape(-1, self.page_size)
        pages = by_page[:, 0] // self.page_size
        if not np.array_equal(by_page, self._slots_of(pages).reshape(-1, self.page_size)):
            raise ValueError(
                f"{op}: slots must come in whole, ordered pages of {self.page_size}"
            )
        if (pages == 0).any():
            raise ValueError(f"{op}: page 0 of pool '{self.name}' is reserved for padding")
        # Ascending pages (what allocations hand out) are distinct without a sort.
        ascending = bool((pages[1:] > pages[:-1]).all())
        if not ascending and np.unique(pages).size != pages.size:
            raise ValueError(f"{op}: the same page appears twice")
        return pages

    def is_allocated(self, indices: Indices) -> bool:
        """True when every page of ``indices`` is currently allocated."""
        pages = self.pages_of(indices, op=f"is_allocated on pool '{self.name}'")
        return not bool(self._is_free[pages].any())

    def first_unallocated(self, indices: Indices, *, op: str) -> int | None:
        """First slot of ``indices`` whose page is not allocated, or ``None`` if all are.

        Validates ``indices`` as :meth:`pages_of` does (raises ``ValueError`` for partial or
        repeated pages, page 0, out-of-range values) before looking at ownership; vectorised,
        proportional to ``len(indices)``.
        """
        pages = self.pages_of(indices, op=op)
        free = np.flatnonzero(self._is_free[pages])
        return int(pages[free[0]]) * self.page_size if free.size else None

    def used_pages(self) -> np.ndarray:
        """Ids of allocated pages (for integrity checks of the owners)."""
        used = np.flatnonzero(~self._is_free)
        return used[used != 0]

    def free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(first page, length)`` of every run of consecutive free pages, lowest first."""
        padded = np.concatenate(([False], self._is_free, [False]))
        edges = np.flatnonzero(np.diff(padded.astype(np.int8)))
        starts, ends = edges[0::2], edges[1::2]
        return starts, ends - starts

    def _pick_pages(self, num_pages: int) -> np.ndarray:
        if num_pages == 0:
            return np.empty(0, dtype=np.int64)
        starts, lengths = self.free_runs()
        fitting = np.flatnonzero(lengths >= num_pages)
        if fitting.size:
            best = fitting[np.argmin(lengths[fitting])]  # argmin takes the lowest among ties
            return np.arange(starts[best], starts[best] + num_pages, dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")
        taken = np.cumsum(lengths[order])
        used = order[: int(np.searchsorted(taken, num_pages)) + 1]
        return np.sort(_expand_runs(starts[used], lengths[used]))[:num_pages]

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` unless free + used == capacity and page 0 is reserved."""
        num_free = int(self._is_free.sum())
        if self._is_free[0]:
            raise RuntimeError(f"pool '{self.name}': reserved page 0 is marked free")
        if num_free != self._num_free_pages:
            raise RuntimeError(
                f"pool '{self.name}': free count {self._num_free_pages} pages != "
                f"{num_free} pages marked free"
            )
        num_used = int(self.used_pages().size)
        if num_free + num_used != self.num_pages:
            raise RuntimeError(
                f"pool '{self.name}': free {num_free} + used {num_used} pages != "
                f"capacity {self.num_pages} pages"
            )

    def _slots_of(self, pages: np.ndarray) -> np.ndarray:
        return (pages[:, None] * self.page_size + self._page_offsets[None, :]).reshape(-1)


def _expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every page of the runs ``(starts[i], lengths[i])``, run after run, vectorised (a page
    size 1 pool may have tens of thousands of one-page runs)."""
    run_offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - run_offsets, lengths) + np.arange(int(lengths.sum()))
