"""PageAllocator: exact ids, exhaustion, refused frees and integrity checks (CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache.pools import IndexSpace, Indices, PageAllocator

PAGE_SIZE = 4
NUM_PAGES = 4  # usable; slots 0..19 with page 0 (slots 0..3) reserved


def _full(*slots: int, dtype: torch.dtype = torch.int64) -> Indices:
    """DEVICE_FULL indices of ``slots``."""
    return Indices(torch.tensor(slots, dtype=dtype), IndexSpace.DEVICE_FULL)


def _ids(indices: Indices | None) -> list[int]:
    """Slot ids of an allocation as a plain list."""
    assert indices is not None, "allocation unexpectedly failed"
    return indices.tensor.tolist()


@pytest.fixture
def alloc() -> Iterator[PageAllocator]:
    """A 4-page allocator of 4-slot pages, integrity-checked after the test."""
    allocator = PageAllocator(NUM_PAGES, PAGE_SIZE, IndexSpace.DEVICE_FULL, "full")
    yield allocator
    allocator.check_integrity()


# ---- handing out ---------------------------------------------------------------------------


def test_first_alloc_gives_lowest_pages_after_reserved_page(alloc: PageAllocator) -> None:
    """The first 8 tokens get pages 1 and 2: slots 4..11, int64 DEVICE_FULL on the CPU."""
    got = alloc.try_alloc(8)
    assert _ids(got) == list(range(4, 12))
    assert got.tensor.dtype == torch.int64
    assert got.space is IndexSpace.DEVICE_FULL
    assert got.device == torch.device("cpu")


def test_consecutive_allocs_continue_upward(alloc: PageAllocator) -> None:
    """A second allocation starts at the next free page."""
    assert _ids(alloc.try_alloc(4)) == [4, 5, 6, 7]
    assert _ids(alloc.try_alloc(8)) == list(range(8, 16))


def test_counts_follow_allocations(alloc: PageAllocator) -> None:
    """Capacity, free and used token counts exclude the reserved page."""
    assert (alloc.capacity_tokens, alloc.num_free_tokens, alloc.num_slots) == (16, 16, 20)
    alloc.try_alloc(12)
    assert (alloc.num_free_tokens, alloc.num_used_tokens) == (4, 12)
    assert alloc.can_alloc(4) and not alloc.can_alloc(8)


def test_exhaustion_returns_none_and_allocates_nothing(alloc: PageAllocator) -> None:
    """A request larger than what is free returns None and leaves every free page free."""
    alloc.try_alloc(12)
    assert alloc.try_alloc(8) is None
    assert alloc.num_free_tokens == 4
    assert _ids(alloc.try_alloc(4)) == [16, 17, 18, 19]


def test_request_above_capacity_returns_none(alloc: PageAllocator) -> None:
    """Asking a fresh pool for more than its capacity returns None."""
    assert alloc.try_alloc(20) is None
    assert alloc.num_free_tokens == 16


def test_non_page_multiple_alloc_raises(alloc: PageAllocator) -> None:
    """6 tokens with 4-token pages is refused, naming the pool, the count and the page size."""
    with pytest.raises(ValueError, match=r"pool 'full'.*6 tokens is not a whole number of pages "
                                         r"of 4 tokens"):
        alloc.try_alloc(6)
    assert alloc.num_free_tokens == 16


def test_negative_alloc_raises(alloc: PageAllocator) -> None:
    """A negative token count is refused."""
    with pytest.raises(ValueError, match=r"num_tokens must be >= 0, got -4"):
        alloc.try_alloc(-4)


def test_empty_alloc_is_a_no_op(alloc: PageAllocator) -> None:
    """Allocating 0 tokens returns empty int64 indices and allocates nothing."""
    got = alloc.try_alloc(0)
    assert got is not None and got.tensor.shape == (0,) and got.tensor.dtype == torch.int64
    assert alloc.num_free_tokens == 16


def test_constructor_rejects_zero_pages() -> None:
    """A pool needs at least one usable page."""
    with pytest.raises(ValueError, match=r"pool 'x': needs at least one usable page, got 0"):
        PageAllocator(0, 4, IndexSpace.DEVICE_FULL, "x")


def test_constructor_rejects_zero_page_size() -> None:
    """page_size 0 is refused."""
    with pytest.raises(ValueError, match=r"pool 'x': page_size must be >= 1, got 0"):
        PageAllocator(2, 0, IndexSpace.DEVICE_FULL, "x")


# ---- freeing -------------------------------------------------------------------------------


def test_free_then_alloc_reuses_lowest_pages(alloc: PageAllocator) -> None:
    """After freeing page 2, an 8-token request gets page 2 then page 4: slots 8..11, 16..19."""
    alloc.try_alloc(12)
    alloc.free(_full(8, 9, 10, 11))
    assert _ids(alloc.try_alloc(8)) == [8, 9, 10, 11, 16, 17, 18, 19]


def test_free_returns_pages_to_the_count(alloc: PageAllocator) -> None:
    """Freeing 8 allocated slots makes 8 tokens free again."""
    got = alloc.try_alloc(8)
    alloc.free(got)
    assert alloc.num_free_tokens == 16


def test_free_accepts_int32_indices(alloc: PageAllocator) -> None:
    """int32 slot ids are freed like int64 ones."""
    alloc.try_alloc(4)
    alloc.free(_full(4, 5, 6, 7, dtype=torch.int32))
    assert alloc.num_free_tokens == 16


def test_free_accepts_pages_in_any_order(alloc: PageAllocator) -> None:
    """Whole pages may come in any page order as long as each page's slots are ordered."""
    alloc.try_alloc(8)
    alloc.free(_full(8, 9, 10, 11, 4, 5, 6, 7))
    assert alloc.num_free_tokens == 16


def test_empty_free_is_a_no_op(alloc: PageAllocator) -> None:
    """Freeing no slots changes nothing."""
    alloc.try_alloc(4)
    alloc.free(_full())
    assert alloc.num_free_tokens == 12


def test_double_free_raises(alloc: PageAllocator) -> None:
    """Freeing the same page twice names the slot, the page and the likely cause."""
    got = alloc.try_alloc(4)
    alloc.free(got)
    with pytest.raises(ValueError, match=r"pool 'full': slot 4 \(page 1\) is not allocated: "
                                         r"a double free"):
        alloc.free(got)
    assert alloc.num_free_tokens == 16


def test_free_of_never_allocated_slot_raises(alloc: PageAllocator) -> None:
    """Freeing a page that was never handed out is refused."""
    alloc.try_alloc(4)
    with pytest.raises(ValueError, match=r"slot 8 \(page 2\) is not allocated"):
        alloc.free(_full(8, 9, 10, 11))


def test_refused_free_frees_nothing(alloc: PageAllocator) -> None:
    """A free naming one allocated and one free page raises and keeps the allocated page."""
    alloc.try_alloc(4)
    with pytest.raises(ValueError, match=r"slot 8 \(page 2\) is not allocated"):
        alloc.free(_full(4, 5, 6, 7, 8, 9, 10, 11))
    assert alloc.num_free_tokens == 12
    assert alloc.is_allocated(_full(4, 5, 6, 7))


def test_free_of_reserved_page_raises(alloc: PageAllocator) -> None:
    """The padding page 0 can never be freed."""
    with pytest.raises(ValueError, match=r"page 0 of pool 'full' is reserved for padding"):
        alloc.free(_full(0, 1, 2, 3))


def test_free_of_partial_page_raises(alloc: PageAllocator) -> None:
    """Two slots of a 4-slot page are not a whole page."""
    alloc.try_alloc(4)
    with pytest.raises(ValueError, match=r"2 slots is not a whole number of pages of 4"):
        alloc.free(_full(4, 5))


def test_free_of_misaligned_slots_raises(alloc: PageAllocator) -> None:
    """Four slots straddling two pages are not a page."""
    alloc.try_alloc(8)
    with pytest.raises(ValueError, match=r"slots must come in whole, ordered pages of 4"):
        alloc.free(_full(5, 6, 7, 8))


def test_free_of_unordered_page_raises(alloc: PageAllocator) -> None:
    """The slots of one page must come in order."""
    alloc.try_alloc(4)
    with pytest.raises(ValueError, match=r"slots must come in whole, ordered pages of 4"):
        alloc.free(_full(5, 4, 6, 7))


def test_free_of_repeated_page_raises(alloc: PageAllocator) -> None:
    """The same page twice in one call is refused before anything is freed."""
    alloc.try_alloc(4)
    with pytest.raises(ValueError, match=r"the same page appears twice"):
        alloc.free(_full(4, 5, 6, 7, 4, 5, 6, 7))
    assert alloc.num_free_tokens == 12


def test_free_of_out_of_range_slot_raises(alloc: PageAllocator) -> None:
    """Slots past the pool name the value and the valid range."""
    with pytest.raises(ValueError, match=r"23 is out of range for pool 'full' "
                                         r"\(valid slots are 0\.\.19\)"):
        alloc.free(_full(20, 21, 22, 23))


def test_free_of_other_space_raises(alloc: PageAllocator) -> None:
    """HOST_FULL slots handed to a DEVICE_FULL allocator are refused, naming both spaces."""
    alloc.try_alloc(4)
    host = Indices(torch.tensor([4, 5, 6, 7]), IndexSpace.HOST_FULL)
    with pytest.raises(ValueError, match=r"pool 'full' takes indices in space DEVICE_FULL, "
                                         r"got HOST_FULL"):
        alloc.free(host)
    assert alloc.num_free_tokens == 12


def test_is_allocated_tracks_pages(alloc: PageAllocator) -> None:
    """is_allocated is true for handed-out pages and false once they are freed."""
    got = alloc.try_alloc(4)
    assert alloc.is_allocated(got)
    alloc.free(got)
    assert not alloc.is_allocated(got)


def test_used_pages_lists_allocated_pages(alloc: PageAllocator) -> None:
    """used_pages gives the allocated page ids without the reserved page."""
    alloc.try_alloc(8)
    alloc.free(_full(4, 5, 6, 7))
    assert alloc.used_pages().tolist() == [2]


# ---- integrity -----------------------------------------------------------------------------


def _corruptible() -> PageAllocator:
    """An allocator with pages 1 and 2 in use, to be corrupted (no integrity fixture)."""
    allocator = PageAllocator(NUM_PAGES, PAGE_SIZE, IndexSpace.DEVICE_FULL, "full")
    allocator.try_alloc(8)
    allocator.check_integrity()
    return allocator


def test_integrity_detects_wrong_free_count() -> None:
    """A free count that disagrees with the free map raises RuntimeError."""
    allocator = _corruptible()
    allocator._num_free_pages += 1
    with pytest.raises(RuntimeError, match=r"pool 'full': free count 3 pages != 2 pages"):
        allocator.check_integrity()


def test_integrity_detects_page_marked_free_behind_the_count() -> None:
    """A page flipped to free without updating the count raises RuntimeError."""
    allocator = _corruptible()
    allocator._is_free[1] = True
    with pytest.raises(RuntimeError, match=r"free count 2 pages != 3 pages marked free"):
        allocator.check_integrity()


def test_integrity_detects_reserved_page_marked_free() -> None:
    """The padding page marked free raises RuntimeError."""
    allocator = _corruptible()
    allocator._is_free[0] = True
    with pytest.raises(RuntimeError, match=r"reserved page 0 is marked free"):
        allocator.check_integrity()


def test_integrity_detects_run_index_behind_the_free_map() -> None:
    """A free map changed behind the run index (counts still right) raises RuntimeError."""
    allocator = _corruptible()
    allocator._is_free[[1, 3]] = [True, False]
    with pytest.raises(RuntimeError, match=r"pool 'full': the free-run index \(1 runs\) differs "
                       r"from the free map \(2 runs\)"):
        allocator.check_integrity()


def test_integrity_detects_run_index_views_disagreeing() -> None:
    """A run index whose by-start and by-end views disagree raises RuntimeError."""
    allocator = _corruptible()
    allocator._runs._start_of_end.clear()
    with pytest.raises(RuntimeError, match=r"pool 'full': free-run index views disagree"):
        allocator.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2, 3, 4])
def test_one_page_frees_are_checked_like_any_other(page_size: int) -> None:
    """A one-page free takes a shorter path; every malformed page is still refused, by the
    same message, and changes nothing, at every page size (1 and 2 compare only the ends)."""
    allocator = PageAllocator(4, page_size, IndexSpace.DEVICE_FULL, "full")
    first = allocator.try_alloc(page_size)
    second = allocator.try_alloc(page_size)
    assert first is not None and second is not None
    base = page_size  # page 1's first slot
    bad = [list(range(base + 1, base + 1 + page_size)) if page_size > 1  # misaligned
           else [3],  # never handed out
           [base] * page_size if page_size > 1 else [5 * page_size],  # repeated / out of range
           list(reversed(range(base, base + page_size))) if page_size > 1 else [0]]
    for slots in bad:
        with pytest.raises(ValueError):
            allocator.free(Indices(torch.tensor(slots), IndexSpace.DEVICE_FULL))
        assert allocator.num_free_tokens == 2 * page_size
    with pytest.raises(ValueError, match="takes indices in space DEVICE_FULL"):
        allocator.free(Indices(first.tensor, IndexSpace.HOST_FULL))
    allocator.free(Indices(first.tensor.to(torch.int32), IndexSpace.DEVICE_FULL))
    with pytest.raises(ValueError, match="is not allocated: a double free"):
        allocator.free(first)
    assert allocator.num_free_tokens == 3 * page_size
    allocator.check_integrity()
