"""Audit of the pools against plain models.

- ``PageAllocator.try_alloc(np.int64(4))`` was taken (numpy integers pass the check) but the
  numpy value went on into the free-run index: the next plain allocation marked its pages
  used and then raised, the pages lost for good. A numpy ``page_size`` did the same, and a
  float ``page_size`` was taken and failed at the first allocation.
- An empty allocation of a hybrid pool (``try_alloc(0)``, ``try_alloc_swa`` of no slots)
  changed nothing in the full-to-SWA map but bumped its version: a forward's valid
  ``ForwardLocs`` and every SWA page table translated before were refused as stale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.pools import (
    AttentionKind,
    HybridSWAPool,
    IndexSpace,
    Indices,
    PageAllocator,
    PageTable,
    RowGeometry,
)

FULL = IndexSpace.DEVICE_FULL


def hybrid_pool(page_size: object = 2) -> HybridSWAPool:
    return HybridSWAPool(num_layers=2, swa_layers=[1], full_pages=8, swa_pages=8,
                         page_size=page_size,  # type: ignore[arg-type]
                         geometry=RowGeometry(AttentionKind.MHA, 1, 2, 0, torch.float32),
                         device="cpu")


@pytest.mark.parametrize("num_tokens", [np.int64(4), np.int32(4), np.uint64(4)])
def test_a_numpy_count_allocates_like_an_int_and_leaves_the_index_whole(
        num_tokens: object) -> None:
    allocator = PageAllocator(8, 2, FULL, "full")
    first = allocator.try_alloc(num_tokens)  # type: ignore[arg-type]
    assert first is not None and first.tensor.tolist() == [2, 3, 4, 5]
    second = allocator.try_alloc(4)
    assert second is not None and second.tensor.tolist() == [6, 7, 8, 9]
    allocator.free(first)
    allocator.free(second)
    assert allocator.num_free_tokens == 16
    allocator.check_integrity()


def test_a_numpy_page_size_is_an_int_and_a_float_one_is_refused() -> None:
    allocator = PageAllocator(np.int64(8), np.int64(2), FULL, "full")  # type: ignore[arg-type]
    assert type(allocator.page_size) is int and type(allocator.num_pages) is int
    assert allocator.try_alloc(4) is not None and allocator.try_alloc(4) is not None
    allocator.check_integrity()
    with pytest.raises(TypeError, match="pool 'full': page_size must be an int, got float"):
        PageAllocator(8, 2.0, FULL, "full")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pool 'full': num_pages must be an int"):
        PageAllocator(8.0, 2, FULL, "full")  # type: ignore[arg-type]


def test_a_hybrid_pool_takes_numpy_counts_and_page_sizes() -> None:
    pool = hybrid_pool(np.int64(2))
    first = pool.try_alloc(np.int64(4))  # type: ignore[arg-type]
    second = pool.try_alloc(4)
    assert first is not None and second is not None
    pool.free(first)
    pool.free(second)
    pool.check_integrity()
    assert pool.full_allocator.num_free_tokens == 16


def test_an_empty_allocation_keeps_forward_locs_valid() -> None:
    pool = hybrid_pool()
    slots = pool.try_alloc(4)
    assert slots is not None
    locs = pool.forward_locs(slots)
    version = pool.map_version
    assert pool.try_alloc(0) is not None
    assert pool.try_alloc_swa(Indices(torch.empty(0, dtype=torch.int64), FULL)) is not None
    assert pool.map_version == version
    rows = torch.ones(4, 1, 2)
    pool.set_kv(1, locs, rows, rows)  # not refused as stale


def test_an_empty_allocation_keeps_translated_tables_valid() -> None:
    pool = hybrid_pool()
    slots = pool.try_alloc(4)
    assert slots is not None
    table = pool.translate_page_table(PageTable(torch.tensor([[1, 2]]), FULL, 2))
    pool.try_alloc(0)
    assert pool.page_slots(1, table, 0).tensor.tolist() == pool.swa_slots_of(slots).tensor.tolist()
