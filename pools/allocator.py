"""Page allocator shared by every pool (device full, device SWA, host full, host SWA).

Bookkeeping only: plain CPU data, no stream, no device tensor. Requests are placed in runs of
consecutive pages wherever the free list allows (``try_alloc``), so copies of a page set are
long (the copy engine needs contiguous host runs). Page 0 is reserved for padding, never
handed out. An index of the free runs (:class:`FreeRuns`) finds the run to use without a
scan, so an allocation or a free costs per run it touches; one that would touch more runs
than it leaves (a large load into scattered holes) is taken from the free map in bulk
(:mod:`.free_map_take`), the same pages."""

from __future__ import annotations

import numpy as np
import torch

from .arg_checks import check_int
from .base import IndexSpace, Indices, check_page_multiple
from .free_map_take import take_longest_runs
from .free_runs import FreeRuns
from .nonzero_count import count_nonzero
from .page_ids import (
    checked_pages,
    is_run,
    not_allocated_message,
    page_ids,
    page_outside,
    single_page,
)
from .page_runs import FEW_RUNS, expand_runs, runs_of
from .snapshot import AllocatorSnapshot, used_pages_of

__all__ = ["AllocatorSnapshot", "PageAllocator", "used_pages_of"]

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
        num_pages = check_int(num_pages, "num_pages", f"pool '{name}'")
        page_size = check_int(page_size, "page_size", f"pool '{name}'")
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
        self._runs = FreeRuns(num_pages)

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
        first among equals); if no run is long enough, the longest runs are taken first (lower
        first among equals) and the request gets their lowest pages, so a copy of the result
        needs as few contiguous pieces as the free list allows. Costs a few sorted-index
        operations per run used, or, where that costs more, a few vectorised passes over the
        free map.

        Returns:
            int64 CPU :class:`Indices` of shape ``[num_tokens]`` in ascending slot order, or
            ``None`` when fewer than ``num_tokens`` slots are free (nothing allocated then).
        """
        got = self._take(num_tokens)
        if got is None:
            return None
        if isinstance(got, int):
            start, end = got * self.page_size, (got + num_tokens // self.page_size) * self.page_size
            return Indices(torch.from_numpy(np.arange(start, end, dtype=np.int64)), self.space)
        return Indices(torch.from_numpy(expand_runs(got, self.page_size)), self.space)

    def try_alloc_pages(self, num_tokens: int) -> tuple[Indices, np.ndarray] | None:
        """:meth:`try_alloc`, with the page ids of the slots it hands out (a new int64
        array, in slot order) for a caller that tracks pages."""
        got = self._take(num_tokens)
        if got is None:
            return None
        if isinstance(got, int):  # one run, the common case first
            end = got + num_tokens // self.page_size
            slots = np.arange(got * self.page_size, end * self.page_size, dtype=np.int64)
            return (Indices(torch.from_numpy(slots), self.space),
                    np.arange(got, end, dtype=np.int64))
        slots = expand_runs(got, self.page_size)  # the page ids of many runs are new: handed over
        return (Indices(torch.from_numpy(slots), self.space),
                got if isinstance(got, np.ndarray) else expand_runs(got, 1))

    def _take(self, num_tokens: int) -> int | list[tuple[int, int]] | np.ndarray | None:
        """Allocate the pages of :meth:`try_alloc`: the first page of the one run they
        form, the ``(first page, length)`` runs of a few runs, ascending (none for no
        tokens), or the page ids of many (a new array); ``None`` when they are not free."""
        if type(num_tokens) is not int:  # a float or numpy int would corrupt the run index
            num_tokens = check_int(num_tokens, "num_tokens", f"alloc from pool '{self.name}'")
        if num_tokens < 0 or num_tokens % self.page_size:
            check_page_multiple(num_tokens, self.page_size, f"alloc from pool '{self.name}'")
        num_pages = num_tokens // self.page_size
        if num_pages > self._num_free_pages:
            return None
        if num_pages == 0:
            return []
        start = self._runs.best_fit(num_pages)
        if start is None:  # no run holds them all: the longest runs
            taken = take_longest_runs(self._runs, self._is_free, num_pages, self.num_pages)
            self._num_free_pages -= num_pages
            return taken
        self._runs.take(start, num_pages)
        if num_pages == 1:
            self._is_free[start] = False  # an item store, no slice object
        else:
            self._is_free[start : start + num_pages] = False
        self._num_free_pages -= num_pages
        return start

    def free(self, indices: Indices) -> None:
        """Return whole pages to the pool.

        Raises:
            ValueError: the indices are not whole pages, name the reserved page, are out of
                range, repeat a page, or name a page that is not allocated (a double free or
                a slot this allocator never handed out). Nothing is freed then.
        """
        page = single_page(indices, self.space, self.page_size, self.num_pages)
        if page is not None:  # the common one-page free: no array
            self._free_page(page)
            return
        self.free_pages(self.pages_of(indices, op=f"free to pool '{self.name}'"))

    def free_pages(self, pages: np.ndarray, *, run_start: int | None = None) -> None:
        """:meth:`free` of page ids that :meth:`pages_of` returned (distinct, in range, not
        page 0): raises ``ValueError`` for a page that is not allocated, freeing nothing.
        ``run_start``: as :meth:`checked_pages_of` gave it (found here otherwise)."""
        size = int(pages.size)
        if size == 1:  # the common single page: Python ints, no array calls
            self._free_page(pages.item())
            return
        if not size:
            return
        if run_start is None and is_run(pages):
            run_start = int(pages[0])
        outside = page_outside(pages, self.num_pages, run_start)
        if outside is not None:
            self._raise_not_allocated(outside)
        if run_start is not None:  # an allocation's pages: a slice of the free map, one run
            is_free = self._is_free[run_start:run_start + size]
            if count_nonzero(is_free):
                self._raise_not_allocated(run_start + int(is_free.argmax()))
            is_free[:] = True
            starts, lengths = [run_start], [size]
        else:
            is_free = self._is_free[pages]
            if count_nonzero(is_free):
                self._raise_not_allocated(int(pages[np.flatnonzero(is_free)[0]]))
            self._is_free[pages] = True
            starts, lengths = runs_of(pages)
        self._num_free_pages += size
        if len(starts) <= FEW_RUNS:
            for start, length in zip(starts, lengths, strict=True):
                self._runs.add(start, length)
        else:
            self._runs.add_many(starts, lengths)

    def _free_page(self, page: int) -> None:
        if not 0 < page <= self.num_pages or self._is_free[page]:
            self._raise_not_allocated(page)
        self._is_free[page] = True
        self._num_free_pages += 1
        self._runs.add(page, 1)

    def _raise_not_allocated(self, page: int) -> None:
        raise ValueError(not_allocated_message(self.name, page, self.page_size, self.num_pages))

    def pages_of(self, indices: Indices, *, op: str) -> np.ndarray:
        """Page ids of slot ``indices`` that must be whole pages in order, distinct, not the
        padding page, in this pool's space and range; raises ``TypeError``/``ValueError``
        (see :func:`~hicache.pools.page_ids.page_ids`) otherwise. A new array."""
        checked = checked_pages(indices, self.space, self.page_size, self.num_pages)
        return (checked or self.checked_pages_of(indices, op=op))[0]  # the common case first

    def checked_pages_of(self, indices: Indices, *, op: str) -> tuple[np.ndarray, int | None]:
        """``(pages, run_start)``: :meth:`pages_of`, and their first page when they are one
        ascending run (:func:`~hicache.pools.page_ids.checked_pages`), else ``None``: for
        :meth:`first_unallocated_page` and :meth:`free_pages`, or a caller's own slices."""
        checked = checked_pages(indices, self.space, self.page_size, self.num_pages)
        if checked is not None:  # the common case, without page_ids' keyword plumbing
            return checked
        return page_ids(indices, space=self.space, pool_name=self.name, page_size=self.page_size,
                        num_pages=self.num_pages, op=op), None

    def is_allocated(self, indices: Indices) -> bool:
        """True when every page of ``indices`` is currently allocated."""
        pages, start = self.checked_pages_of(indices, op=f"is_allocated on pool '{self.name}'")
        return self.first_unallocated_page(pages, run_start=start, in_range=True) is None

    def first_unallocated(self, indices: Indices, *, op: str) -> int | None:
        """First slot of ``indices`` whose page is not allocated, or ``None`` if all are.

        Validates ``indices`` as :meth:`pages_of` does (raises ``ValueError`` for partial or
        repeated pages, page 0, out-of-range values) before looking at ownership."""
        pages, start = self.checked_pages_of(indices, op=op)
        page = self.first_unallocated_page(pages, run_start=start, in_range=True)
        return None if page is None else page * self.page_size

    def first_unallocated_page(self, pages: np.ndarray, *, run_start: int | None = None,
                               in_range: bool = False) -> int | None:
        """First of ``pages`` (page ids) that is not allocated (outside the pool counts), or
        ``None`` if all are. ``run_start``: as :meth:`checked_pages_of` gave it; ``in_range``:
        they came from it (its range check, not made twice on the op's path)."""
        if pages.size == 1:
            page = pages.item()
            return page if not 0 < page <= self.num_pages or self._is_free[page] else None
        outside = (None if in_range or not pages.size
                   else page_outside(pages, self.num_pages, run_start))
        if outside is not None:
            return outside
        is_free = (self._is_free[pages] if run_start is None  # else a slice, page for page
                   else self._is_free[run_start:run_start + pages.size])
        if not count_nonzero(is_free):
            return None
        return int(pages[np.flatnonzero(is_free)[0]])

    def check_allocated(self, pages: np.ndarray) -> None:
        """Raise :meth:`free`'s ``ValueError`` for the first of ``pages`` (from :meth:`pages_of`)
        not allocated: a caller freeing them with what they own checks first."""
        page = self.first_unallocated_page(pages)
        if page is not None:
            self._raise_not_allocated(page)

    def used_pages(self) -> np.ndarray:
        """Ids of allocated pages (for integrity checks of the owners)."""
        return used_pages_of(self._is_free)

    def free_map(self) -> np.ndarray:
        """A copy of the free map (``[num_pages]`` bool, True = free): a snapshot an
        integrity check reads later, with no lock (see :func:`used_pages_of`)."""
        return self._is_free.copy()

    def free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(first page, length)`` int64 arrays of every run of free pages, lowest first."""
        return self._runs.as_arrays()

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` unless free + used == capacity, page 0 is reserved and the
        free-run index lists exactly the runs of the free map (a scan of the pool)."""
        self._runs.check_integrity(self.name)
        self.verify_snapshot(self.integrity_snapshot())

    def integrity_snapshot(self) -> AllocatorSnapshot:
        """Copies of the free map, the free count and the free-run index: a few array
        copies, for :meth:`verify_snapshot` to check later with no lock."""
        starts, lengths = self._runs.as_arrays()
        return AllocatorSnapshot(self._is_free.copy(), self._num_free_pages, starts, lengths)

    def verify_snapshot(self, snapshot: AllocatorSnapshot) -> None:
        """The checks of :meth:`check_integrity` on ``snapshot`` (the free-run index's own
        views excepted); reads nothing else of the allocator but its name and size."""
        snapshot.verify(self.name, self.num_pages)
