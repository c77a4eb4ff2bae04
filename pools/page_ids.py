"""Page ids of slot indices: the check every allocator call and controller entry makes.

Slot indices name whole pages in order (``page * page_size + 0 .. page_size - 1``). Valid
input, the common case on the scheduler thread, is recognised with a few numpy calls per
call (:func:`valid_pages`); anything else goes through every check in turn so that the
error names the first thing wrong.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .base import INDEX_DTYPES, IndexSpace, Indices, check_indices
from .nonzero_count import count_nonzero

CPU = torch.device("cpu")
_INDEX_DTYPES = frozenset(INDEX_DTYPES)


def page_ids(
    indices: Indices, *, space: IndexSpace, pool_name: str, page_size: int, num_pages: int, op: str
) -> np.ndarray:
    """Page ids (int64, a new array, never a view of the caller's tensor) of ``indices``.

    ``indices`` must be CPU int32/int64 1-D :class:`Indices` of ``space``, whole ordered
    pages of ``page_size`` slots, each page once, none of them the padding page 0, all in
    ``[1, num_pages]``.

    Raises:
        TypeError: not :class:`Indices`.
        ValueError: wrong space, dtype, device or shape; a value out of range
            (:class:`~hicache.pools.BoundsError`); a partial or unordered page; page 0; a
            page twice.
    """
    pages = valid_pages(indices, space, page_size, num_pages)
    if pages is not None:
        return pages
    return _checked_page_ids(
        indices, space=space, pool_name=pool_name, page_size=page_size, num_pages=num_pages, op=op
    )


def _checked_page_ids(
    indices: Indices, *, space: IndexSpace, pool_name: str, page_size: int, num_pages: int, op: str
) -> np.ndarray:
    """:func:`page_ids` one check at a time, raising at the first that fails."""
    tensor = check_indices(
        indices,
        space=space,
        pool_name=pool_name,
        num_slots=(num_pages + 1) * page_size,
        device=CPU,
        op=op,
    )
    slots = tensor.numpy().astype(np.int64, copy=False)
    if slots.size % page_size != 0:
        raise ValueError(f"{op}: {slots.size} slots is not a whole number of pages of {page_size}")
    if slots.size == 0:
        return np.empty(0, dtype=np.int64)
    if page_size == 1:
        pages = slots.copy()  # every slot is a whole page; copied so we never alias the caller
    else:
        by_page = slots.reshape(-1, page_size)
        pages = by_page[:, 0] // page_size
        offsets = np.arange(page_size, dtype=np.int64)
        if not (by_page == pages[:, None] * page_size + offsets).all():
            raise ValueError(f"{op}: slots must come in whole, ordered pages of {page_size}")
    ascending = pages.size == 1 or bool((pages[1:] > pages[:-1]).all())
    has_padding = pages[0] == 0 if ascending else bool((pages == 0).any())
    if has_padding:
        raise ValueError(f"{op}: page 0 of pool '{pool_name}' is reserved for padding")
    if not ascending and np.unique(pages).size != pages.size:
        raise ValueError(f"{op}: the same page appears twice")
    return pages


def valid_pages(
    indices: Indices, space: IndexSpace, page_size: int, num_pages: int
) -> np.ndarray | None:
    """The pages of ``indices`` when every check of :func:`page_ids` passes; ``None``
    otherwise (empty input included), for the long path to name what is wrong."""
    checked = checked_pages(indices, space, page_size, num_pages)
    return None if checked is None else checked[0]


def checked_pages(
    indices: Indices, space: IndexSpace, page_size: int, num_pages: int
) -> tuple[np.ndarray, int | None] | None:
    """``(pages, run_start)``: :func:`valid_pages`, and their first page when they are one
    ascending run (``run_start, run_start + 1, ...``: an allocation's), else ``None``, for a
    caller that can then slice per-page arrays instead of gathering from them (a slice beats
    a gather from 256 pages on, by 2.5 us at 4096). A plain pair: a named tuple costs more
    to make than a one-page check's arithmetic.

    Whole ordered pages whose first slots are page multiples are in range once their lowest
    and highest page are; ascending pages (what allocations hand out) are distinct without a
    sort; others (concatenated frees) sort their pages, not their slots."""
    if type(indices) is not Indices or indices.space is not space:
        return None
    tensor = indices.tensor
    if tensor.dtype not in _INDEX_DTYPES or tensor.dim() != 1 or not tensor.is_cpu:
        return None
    size = tensor.numel()
    if size == page_size:  # one page, the common free and backup: no numpy calls
        page = _page_of(tensor, page_size, num_pages)
        return None if page is None else (np.array((page,), dtype=np.int64), page)
    if size == 0 or size % page_size:
        return None
    return checked_slot_pages(tensor.numpy(), page_size, num_pages)


def valid_slot_pages(slots: np.ndarray, page_size: int, num_pages: int) -> np.ndarray | None:
    """:func:`valid_pages` past its type checks: the pages of ``slots`` (1-D int32/int64,
    a non-empty whole number of pages) when they pass every check of :func:`page_ids`,
    else ``None``. For a caller holding the numpy view of checked slots already (the
    service's insert), which saves the tensor slice and its second view."""
    checked = checked_slot_pages(slots, page_size, num_pages)
    return None if checked is None else checked[0]


def checked_slot_pages(slots: np.ndarray, page_size: int, num_pages: int
                       ) -> tuple[np.ndarray, int | None] | None:
    """``(pages, run_start)`` of :func:`checked_pages` past its type checks."""
    size = slots.size
    first = int(slots[0])
    # one ascending run of whole pages (what an allocation hands out), told as is_run does
    if not first % page_size and int(slots[-1]) - first == size - 1 and not count_nonzero(
            slots[1:] <= slots[:-1]):
        page = first // page_size
        last_page = page + size // page_size - 1
        if page < 1 or last_page > num_pages:
            return None
        return np.arange(page, last_page + 1, dtype=np.int64), page
    # count_nonzero rather than .any()/.all(): a C call, where those go through Python
    if page_size == 1:
        pages = slots.astype(np.int64)  # a copy
    else:
        by_page = slots.reshape(-1, page_size)
        pages = by_page[:, 0].astype(np.int64)  # a copy
        if count_nonzero(pages % page_size) or count_nonzero(
                by_page - _offsets(page_size) - pages[:, None]):
            return None
        pages //= page_size
    if pages.size == 1 or not count_nonzero(pages[1:] <= pages[:-1]):
        low, high = pages[0], pages[-1]
    else:
        ordered = np.sort(pages, kind="stable")  # runs of pages: timsort's best case
        if count_nonzero(ordered[1:] == ordered[:-1]):
            return None
        low, high = ordered[0], ordered[-1]
    return (pages, None) if low >= 1 and high <= num_pages else None


def single_page(indices: Indices, space: IndexSpace, page_size: int, num_pages: int
                ) -> int | None:
    """The page id of ``indices`` when they are exactly one whole valid page of ``space``
    (what a one-page allocation handed out), else ``None`` (the caller takes the general
    path, which names what is wrong): the single-page free without an array."""
    if type(indices) is not Indices or indices.space is not space:
        return None
    tensor = indices.tensor
    if (tensor.dtype not in _INDEX_DTYPES or tensor.dim() != 1 or not tensor.is_cpu
            or tensor.numel() != page_size):
        return None
    return _page_of(tensor, page_size, num_pages)


def _page_of(tensor: torch.Tensor, page_size: int, num_pages: int) -> int | None:
    """The page of ``page_size`` slots ``tensor`` (1-D, CPU) when they are that whole page in
    order and it is in ``[1, num_pages]``, else ``None``."""
    values = tensor.tolist()
    first = values[0]
    if first % page_size or values[-1] != first + page_size - 1 or (
            page_size > 2 and values != [*range(first, first + page_size)]):
        return None
    page = first // page_size
    return page if 1 <= page <= num_pages else None


@functools.lru_cache(maxsize=8)
def _offsets(page_size: int) -> np.ndarray:
    """``[page_size]`` offsets of a page's slots, made once per page size (read-only)."""
    offsets = np.arange(page_size, dtype=np.int64)
    offsets.flags.writeable = False
    return offsets


def is_run(values: np.ndarray) -> bool:
    """True when 1-D integer ``values`` are ``first, first + 1, ..., first + n - 1`` (an
    allocation's slots or pages; empty counts). Integers that go from ``first`` to
    ``first + n - 1`` in ``n - 1`` strictly ascending steps step by one each: the first and
    last value and one comparison of neighbours (a boolean temporary, no arithmetic that
    could wrap) decide it."""
    size = values.size
    if size <= 1:
        return True
    return int(values[-1]) - int(values[0]) == size - 1 and not count_nonzero(
        values[1:] <= values[:-1])


def owned_page_ids(indices: Indices, page_size: int) -> np.ndarray:
    """Page ids (int64, a new array) of slots hicache itself made and checked as whole
    ordered pages (an allocation's output, a tree node's slots, sliced only at page
    boundaries): the first slot of each page names it, one strided read and no checks.
    Never for slots an engine passes in: those go through :func:`page_ids`."""
    return indices.tensor.numpy()[::page_size] // page_size


def page_outside(pages: np.ndarray, num_pages: int, run_start: int | None = None) -> int | None:
    """A page of ``pages`` outside ``1 .. num_pages`` (page 0 is the padding page, never
    allocated; a negative id would index a free map from its end), or ``None``: for callers
    handed page ids rather than slots (``free_pages``, ``evict_*(pages=...)``), which
    :func:`page_ids` did not check. ``run_start``: the first of ``pages`` when they are one
    ascending run (its ends are then the lowest and the highest)."""
    if run_start is not None:
        low, high = run_start, run_start + int(pages.size) - 1
    else:
        low, high = int(pages.min()), int(pages.max())
    if low < 1:
        return low
    return high if high > num_pages else None


def not_allocated_message(pool_name: str, page: int, page_size: int, num_pages: int) -> str:
    """What a free of ``page``, not allocated in pool ``pool_name``, raises."""
    if not 0 < page <= num_pages:
        what = "the padding page, never allocated" if page == 0 else "outside the pool"
        return (f"free to pool '{pool_name}': page {page} is {what} (its pages are 1 .. "
                f"{num_pages}): page ids come from pages_of() of slots this pool handed out")
    return (f"free to pool '{pool_name}': slot {page * page_size} (page {page}) is not "
            f"allocated: a double free, or an index from another pool")
