"""Seed bug classes an audit could still reach through the public API, now refused:

- a stale cached translation (seeds 001, 003): an SWA page table translated before the
  full-to-SWA map changed named another request's SWA pages; it carries the map's version
  and ``page_slots`` refuses it once the map changed;
- garbage in padding (seed 001): slots 1 .. page_size - 1 of the reserved page 0 took rows
  and kept them, which a padded page-table entry then read as data; an indexed write clears
  the whole padding page, and a run of slots is a slice copy only past it;
- validate before mutating (seeds 001, 004): the reference engine's decode buffers (fixed
  addresses, for CUDA-graph replay) took a negative slot or a page past the pool before the
  batch was refused.
"""

from __future__ import annotations

import pytest
import torch

from hicache.engine.attention import DecodeBuffers
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HybridSWAPool,
    IndexSpace,
    Indices,
    PageTable,
    RowGeometry,
)

PAGE = 2
GEOMETRY = RowGeometry(AttentionKind.MHA, 1, 2, 0, torch.float32)


def _hybrid() -> HybridSWAPool:
    return HybridSWAPool(num_layers=4, swa_layers=[1, 3], full_pages=6, swa_pages=3,
                         page_size=PAGE, geometry=GEOMETRY, device="cpu")


def _full(*slots: int) -> Indices:
    return Indices(torch.tensor(slots, dtype=torch.int64), IndexSpace.DEVICE_FULL)


def test_an_swa_page_table_translated_before_the_map_changed_is_refused() -> None:
    pool = _hybrid()
    a = pool.try_alloc(PAGE)  # request A: a full page and its SWA page
    assert a is not None
    full_table = PageTable(torch.tensor([[int(a.tensor[0]) // PAGE]]), IndexSpace.DEVICE_FULL,
                           PAGE)
    swa_table = pool.translate_page_table(full_table)
    assert pool.page_slots(1, swa_table, 0).tensor.tolist() == \
        pool.swa_slots_of(a).tensor.tolist()
    pool.free_swa(a)  # A's tokens leave the window
    b = pool.try_alloc(PAGE)  # request B gets A's old SWA page
    assert b is not None
    with pytest.raises(ValueError, match=r"page_slots\(layer=1\): this SWA page table was "
                                         r"translated with map version \d+, the map is at \d+"):
        pool.page_slots(1, swa_table, 0)
    fresh = pool.translate_page_table(full_table)  # translated again: A's page has no SWA page
    assert pool.page_slots(1, fresh, 0).tensor.tolist() == [0, 1]  # the padding page's
    assert pool.page_slots(0, full_table, 0).tensor.tolist() == a.tensor.tolist()


@pytest.mark.parametrize("through", ["indices", "forward_locs"])
def test_a_row_aimed_at_the_padding_page_is_not_kept(through: str) -> None:
    pool = _hybrid()
    rows = torch.full((1, 1, 2), 9.0)
    locs = _full(1) if through == "indices" else pool.forward_locs(_full(1))
    pool.set_kv(0, locs, rows, rows)
    padding = pool.page_slots(0, PageTable(torch.tensor([[0]]), IndexSpace.DEVICE_FULL, PAGE),
                              0)
    assert pool.key_buffer(0)[padding.tensor].eq(0).all()
    assert pool.value_buffer(0)[padding.tensor].eq(0).all()


def test_a_run_into_the_padding_page_is_written_by_index_and_the_page_cleared() -> None:
    pool = DeviceKVPool(name="full", space=IndexSpace.DEVICE_FULL, num_layers=1, num_slots=8,
                        geometry=GEOMETRY, device="cpu", page_size=PAGE)
    locs = pool.forward_locs(_full(1, 2, 3))
    assert locs.span is None  # not a slice copy over the padding page
    rows = torch.arange(6, dtype=torch.float32).view(3, 1, 2) + 1
    pool.set_kv(0, locs, rows, rows)
    keys = pool.key_buffer(0)
    assert keys[:PAGE].eq(0).all() and torch.equal(keys[2:4], rows[1:])
    assert pool.forward_locs(_full(2, 3, 4)).span == (2, 5)  # past it: a slice copy


def _filled_buffers() -> tuple[HybridSWAPool, DecodeBuffers]:
    pool = _hybrid()
    slots = pool.try_alloc(PAGE)
    assert slots is not None
    buffers = DecodeBuffers(max_batch=4, max_pages=2, device=torch.device("cpu"),
                            page_size=PAGE)
    loc = int(slots.tensor[0])
    buffers.fill(pool, [loc], [0], [[loc // PAGE]])
    return pool, buffers


@pytest.mark.parametrize(("locs", "pages", "message"), [
    ([-1, 3], [[1], [1]], r"slot -1 is negative for pool 'full' \(valid slots are 0\.\.13\)"),
    ([2], [[99]], r"page 99 is out of range for pool 'full' \(valid pages are 0\.\.6\)"),
    ([99], [[1]], r"slot 99 is out of range for pool 'full' \(valid slots are 0\.\.13\)")])
def test_a_refused_decode_batch_leaves_the_graph_buffers_as_they_were(
        locs: list[int], pages: list[list[int]], message: str) -> None:
    pool, buffers = _filled_buffers()
    before = buffers.out_cache_loc.clone(), buffers.page_table.clone()
    with pytest.raises(ValueError, match=rf"^decode batch: {message}; pass only"):
        buffers.fill(pool, locs, [0] * len(locs), pages)
    assert torch.equal(buffers.out_cache_loc, before[0])
    assert torch.equal(buffers.page_table, before[1])
