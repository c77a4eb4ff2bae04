"""PageAllocator: the paths for pages that form one ascending run (slices of the free map)
answer and refuse exactly as the general paths do (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.pools import IndexSpace, Indices, PageAllocator

PAGE_SIZE = 4


def _allocator() -> PageAllocator:
    return PageAllocator(8, PAGE_SIZE, IndexSpace.DEVICE_FULL, "full")


def test_checked_pages_of_tells_a_run() -> None:
    """An allocation's slots are one run, told by its first page; the same pages in another
    order are not."""
    allocator = _allocator()
    got = allocator.try_alloc(3 * PAGE_SIZE)
    assert got is not None
    pages, start = allocator.checked_pages_of(got, op="test")
    assert pages.tolist() == [1, 2, 3] and start == 1
    shuffled = Indices(got.tensor.view(3, PAGE_SIZE)[[2, 0, 1]].reshape(-1), got.space)
    pages, start = allocator.checked_pages_of(shuffled, op="test")
    assert pages.tolist() == [3, 1, 2] and start is None


def test_checked_pages_of_raises_as_pages_of() -> None:
    """A caller mistake gets the message of ``pages_of``."""
    allocator = _allocator()
    with pytest.raises(ValueError, match=r"op: page 0 of pool 'full' is reserved"):
        allocator.checked_pages_of(Indices(torch.arange(8), IndexSpace.DEVICE_FULL), op="op")
    with pytest.raises(ValueError, match="takes indices in space DEVICE_FULL"):
        allocator.checked_pages_of(Indices(torch.arange(4, 8), IndexSpace.HOST_FULL), op="op")


@pytest.mark.parametrize("free", [[], [2], [3, 4], [1, 4]])
def test_first_unallocated_page_of_a_run_reads_as_the_gather(free: list[int]) -> None:
    """With ``run_start`` the answer is the first free page of the run, as without it."""
    allocator = _allocator()
    got = allocator.try_alloc(4 * PAGE_SIZE)
    assert got is not None
    for page in free:
        allocator.free_pages(np.array([page]))
    pages = np.arange(1, 5)
    expected = free[0] if free else None
    assert allocator.first_unallocated_page(pages, run_start=1) == expected
    assert allocator.first_unallocated_page(pages) == expected


def test_free_of_a_run_with_a_free_page_names_it_and_frees_nothing() -> None:
    """Freeing a run that holds a page freed already names that page's first slot."""
    allocator = _allocator()
    got = allocator.try_alloc(4 * PAGE_SIZE)
    assert got is not None
    allocator.free_pages(np.array([3]))
    with pytest.raises(ValueError, match=r"pool 'full': slot 12 \(page 3\) is not allocated: "
                                         r"a double free"):
        allocator.free(got)
    assert allocator.num_free_tokens == 5 * PAGE_SIZE
    assert allocator.used_pages().tolist() == [1, 2, 4]
    allocator.check_integrity()


def test_free_of_a_run_merges_it_with_its_neighbours() -> None:
    """A freed run joins the free runs on both sides into one."""
    allocator = _allocator()
    first, middle, last = (allocator.try_alloc(2 * PAGE_SIZE) for _ in range(3))
    assert first is not None and middle is not None and last is not None
    allocator.free(first)
    allocator.free(last)
    allocator.free(middle)
    starts, lengths = allocator.free_runs()
    assert starts.tolist() == [1] and lengths.tolist() == [8]
    allocator.check_integrity()


def test_free_pages_of_a_run_given_its_start_checks_every_page() -> None:
    """``run_start`` from the check frees the run as without it, and still refuses a run
    that holds a free page, freeing nothing."""
    allocator = _allocator()
    got = allocator.try_alloc(3 * PAGE_SIZE)
    assert got is not None
    pages, start = allocator.checked_pages_of(got, op="test")
    allocator.free_pages(pages, run_start=start)
    assert allocator.num_free_tokens == 8 * PAGE_SIZE
    with pytest.raises(ValueError, match=r"slot 4 \(page 1\) is not allocated"):
        allocator.free_pages(pages, run_start=start)
    allocator.check_integrity()


def test_free_of_scattered_pages_with_free_ones_names_the_first_in_their_order() -> None:
    """Pages in no run order (the gather path) name the first of them, in the order given,
    that is free; nothing is freed."""
    allocator = _allocator()
    got = allocator.try_alloc(5 * PAGE_SIZE)
    assert got is not None
    allocator.free_pages(np.array([2]))
    allocator.free_pages(np.array([4]))
    with pytest.raises(ValueError, match=r"slot 16 \(page 4\) is not allocated"):
        allocator.free_pages(np.array([5, 4, 1, 2]))
    assert allocator.used_pages().tolist() == [1, 3, 5]
    allocator.check_integrity()


def test_first_unallocated_gives_the_first_slot_of_the_first_free_page() -> None:
    """``first_unallocated``: ``None`` while every page is allocated, else the first slot of
    the first page (in the indices' order) that is free."""
    allocator = _allocator()
    got = allocator.try_alloc(3 * PAGE_SIZE)
    assert got is not None
    assert allocator.first_unallocated(got, op="test") is None
    allocator.free_pages(np.array([3]))
    assert allocator.first_unallocated(got, op="test") == 3 * PAGE_SIZE
    one = Indices(torch.arange(2 * PAGE_SIZE, 3 * PAGE_SIZE), IndexSpace.DEVICE_FULL)
    assert allocator.first_unallocated(one, op="test") is None
    other = Indices(torch.arange(3 * PAGE_SIZE, 4 * PAGE_SIZE), IndexSpace.DEVICE_FULL)
    assert allocator.first_unallocated(other, op="test") == 3 * PAGE_SIZE


def test_check_allocated_refuses_a_free_page_and_passes_allocated_ones() -> None:
    """``check_allocated`` raises the double-free message for the first free page and is
    silent when every page is allocated; it changes nothing."""
    allocator = _allocator()
    assert allocator.try_alloc(3 * PAGE_SIZE) is not None
    allocator.check_allocated(np.array([3, 1]))
    allocator.free_pages(np.array([2]))
    with pytest.raises(ValueError, match=r"slot 8 \(page 2\) is not allocated"):
        allocator.check_allocated(np.array([3, 2, 1]))
    assert allocator.used_pages().tolist() == [1, 3]
    allocator.check_integrity()
