"""HybridSWAPool: translation, page tables, decode buffers, SWA writes, allocation (CPU).

The ``shifted`` fixture makes full and SWA slot ids differ, so a write or read that uses a
full slot in the SWA pool (the first seed's bug) lands on a row the test can see:

    full pages 1, 2 (slots 2..5): allocated, no SWA slot (their tokens left the window)
    full pages 3, 4 (slots 6..9): SWA pages 1, 2 (slots 2..5)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from hicache.pools import (
    DEBUG_CHECKS_ENV,
    AttentionKind,
    BoundsError,
    HybridSWAPool,
    IndexSpace,
    Indices,
    PageTable,
    RowGeometry,
)

PAGE_SIZE = 2
FULL_PAGES, SWA_PAGES = 6, 3  # full slots 0..13, SWA slots 0..7
HEADS, HEAD_DIM = 1, 2
GEOMETRY = RowGeometry(AttentionKind.MHA, HEADS, HEAD_DIM, 0, torch.float32)
SENTINEL = -7.0


def _make_pool() -> HybridSWAPool:
    """4 layers, SWA layers 1 and 3, 6 full and 3 SWA pages of 2 slots, on the CPU."""
    return HybridSWAPool(
        num_layers=4, swa_layers=[1, 3], full_pages=FULL_PAGES, swa_pages=SWA_PAGES,
        page_size=PAGE_SIZE, geometry=GEOMETRY, device="cpu",
    )


def _full(*slots: int, dtype: torch.dtype = torch.int64) -> Indices:
    """DEVICE_FULL indices of ``slots``."""
    return Indices(torch.tensor(slots, dtype=dtype), IndexSpace.DEVICE_FULL)


def _ids(indices: Indices | None) -> list[int]:
    """Slot ids of an allocation or translation as a plain list."""
    assert indices is not None, "allocation unexpectedly failed"
    return indices.tensor.tolist()


def _kv(n: int, start: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` position-dependent K rows and V rows (V = K + 100)."""
    k = torch.arange(start, start + n * HEADS * HEAD_DIM).reshape(n, HEADS, HEAD_DIM)
    return k, k + 100.0


@pytest.fixture
def pool() -> Iterator[HybridSWAPool]:
    """A fresh pool, integrity-checked after the test."""
    hybrid = _make_pool()
    yield hybrid
    hybrid.check_integrity()


@pytest.fixture
def shifted(pool: HybridSWAPool) -> HybridSWAPool:
    """Full slots 2..5 without SWA slots; full slots 6..9 mapped to SWA slots 2..5."""
    old = pool.try_alloc(4)
    assert _ids(old) == [2, 3, 4, 5]
    pool.free_swa(old)
    assert _ids(pool.try_alloc(4)) == [6, 7, 8, 9]
    assert _ids(pool.swa_slots_of(_full(6, 7, 8, 9))) == [2, 3, 4, 5]
    return pool


# ---- layout --------------------------------------------------------------------------------


def test_layer_mapping_splits_swa_and_full_layers(pool: HybridSWAPool) -> None:
    """swa_layers [1, 3] of 4: layers 0, 2 are full 0, 1; layers 1, 3 are SWA 0, 1."""
    assert pool.layer_mapping == [(False, 0), (True, 0), (False, 1), (True, 1)]
    assert [pool.is_swa_layer(i) for i in range(4)] == [False, True, False, True]
    assert pool.pool_of(3) == (pool.swa, 1)
    assert pool.pool_of(2) == (pool.full, 1)
    assert (pool.full.num_layers, pool.swa.num_layers) == (2, 2)
    assert (pool.full.num_slots, pool.swa.num_slots) == (14, 8)


def test_pool_of_refuses_layer_out_of_range(pool: HybridSWAPool) -> None:
    """Model layer 4 of 4 is refused, naming the range."""
    with pytest.raises(ValueError, match=r"layer 4 out of range \(0\.\.3\)"):
        pool.pool_of(4)


@pytest.mark.parametrize("swa_layers", [[], [4]])
def test_constructor_refuses_bad_swa_layers(swa_layers: list[int]) -> None:
    """SWA layers must be a non-empty subset of the model's layers."""
    with pytest.raises(ValueError, match=r"must be a non-empty subset of 0\.\.3"):
        HybridSWAPool(num_layers=4, swa_layers=swa_layers, full_pages=2, swa_pages=1,
                      page_size=2, geometry=GEOMETRY, device="cpu")


def test_constructor_refuses_a_model_of_sliding_window_layers_only() -> None:
    """Every layer sliding-window would leave a full pool of no layers: refused, as the
    config refuses it; three of four are fine."""
    with pytest.raises(ValueError, match=r"swa_layers \[0, 1, 2, 3\] must be a non-empty "
                                         r"subset of 0\.\.3 that leaves the full pool at "
                                         r"least one full-attention layer"):
        HybridSWAPool(num_layers=4, swa_layers=[3, 2, 1, 0], full_pages=2, swa_pages=1,
                      page_size=2, geometry=GEOMETRY, device="cpu")
    pool = HybridSWAPool(num_layers=4, swa_layers=[0, 1, 3], full_pages=2, swa_pages=1,
                         page_size=2, geometry=GEOMETRY, device="cpu")
    assert pool.full.num_layers == 1 and pool.swa.num_layers == 3


# ---- allocation ----------------------------------------------------------------------------


def test_try_alloc_maps_each_full_page_to_an_swa_page(pool: HybridSWAPool) -> None:
    """The first allocation takes full and SWA pages 1, 2: both slots 2..5."""
    assert _ids(pool.try_alloc(4)) == [2, 3, 4, 5]
    assert _ids(pool.swa_slots_of(_full(2, 3, 4, 5))) == [2, 3, 4, 5]
    assert (pool.full_allocator.num_free_tokens, pool.swa_allocator.num_free_tokens) == (8, 2)


def test_try_alloc_rolls_back_when_swa_is_exhausted(pool: HybridSWAPool) -> None:
    """With SWA full, try_alloc returns None and the full allocator is unchanged."""
    pool.try_alloc(6)
    used_before = pool.full_allocator.used_pages().tolist()
    assert pool.try_alloc(2) is None
    assert pool.full_allocator.used_pages().tolist() == used_before == [1, 2, 3]
    assert pool.full_allocator.num_free_tokens == 6


def test_try_alloc_returns_none_when_full_is_exhausted(pool: HybridSWAPool) -> None:
    """More tokens than free full slots returns None and allocates nothing in either pool."""
    assert pool.try_alloc(14) is None
    assert (pool.full_allocator.num_free_tokens, pool.swa_allocator.num_free_tokens) == (12, 6)


def test_free_releases_full_and_swa_slots(pool: HybridSWAPool) -> None:
    """free returns both the full pages and their SWA pages."""
    slots = pool.try_alloc(4)
    pool.free(slots)
    assert (pool.full_allocator.num_free_tokens, pool.swa_allocator.num_free_tokens) == (12, 6)
    assert _ids(pool.swa_slots_of(slots)) == [0, 0, 0, 0]


def test_free_with_one_page_not_allocated_frees_nothing(pool: HybridSWAPool) -> None:
    """A free naming an allocated page and a freed one (a double free) raises before it
    touches anything: the allocated page keeps its full and its SWA page."""
    kept, gone = pool.try_alloc(2), pool.try_alloc(2)
    assert _ids(kept) == [2, 3] and _ids(gone) == [4, 5]
    pool.free(gone)
    with pytest.raises(ValueError, match=r"slot 4 \(page 2\) is not allocated: a double free"):
        pool.free(_full(2, 3, 4, 5))
    assert pool.full_allocator.used_pages().tolist() == [1]
    assert pool.swa_allocator.used_pages().tolist() == [1]
    assert _ids(pool.swa_slots_of(kept)) == [2, 3]


def test_free_of_chunk_without_swa_slots_frees_full_pages(shifted: HybridSWAPool) -> None:
    """Full pages whose SWA pages are gone free only their full pages."""
    shifted.free(_full(2, 3, 4, 5))
    assert shifted.full_allocator.used_pages().tolist() == [3, 4]
    assert shifted.swa_allocator.used_pages().tolist() == [1, 2]


def test_free_swa_keeps_full_slots(pool: HybridSWAPool) -> None:
    """free_swa releases the SWA pages only."""
    slots = pool.try_alloc(4)
    pool.free_swa(slots)
    assert (pool.full_allocator.num_free_tokens, pool.swa_allocator.num_free_tokens) == (8, 6)
    assert pool.full_allocator.is_allocated(slots)


def test_free_swa_of_one_page_of_a_chunk(pool: HybridSWAPool) -> None:
    """free_swa of the first page of a 2-page chunk unmaps only that page."""
    slots = pool.try_alloc(4)
    pool.free_swa(_full(2, 3))
    assert _ids(pool.swa_slots_of(slots)) == [0, 0, 4, 5]
    assert pool.swa_allocator.used_pages().tolist() == [2]


def test_free_swa_is_idempotent(pool: HybridSWAPool) -> None:
    """A second free_swa of the same slots changes nothing."""
    slots = pool.try_alloc(4)
    pool.free_swa(slots)
    pool.free_swa(slots)
    assert pool.swa_allocator.num_free_tokens == 6


def test_try_alloc_swa_gives_slots_back_to_unmapped_pages(shifted: HybridSWAPool) -> None:
    """Full slots 2..5 get the lowest free SWA page again: SWA slots 6, 7 for full 2, 3."""
    assert _ids(shifted.try_alloc_swa(_full(2, 3))) == [6, 7]
    assert _ids(shifted.swa_slots_of(_full(2, 3, 4, 5))) == [6, 7, 0, 0]


def test_try_alloc_swa_refuses_mapped_slots(pool: HybridSWAPool) -> None:
    """Full slots that already have an SWA slot are refused."""
    slots = pool.try_alloc(2)
    with pytest.raises(ValueError, match=r"try_alloc_swa: some full slots already have an "
                                         r"SWA slot"):
        pool.try_alloc_swa(slots)


def test_try_alloc_swa_refuses_unallocated_full_slots(pool: HybridSWAPool) -> None:
    """SWA slots are given only to allocated full slots."""
    with pytest.raises(ValueError, match=r"try_alloc_swa: some full slots are not allocated "
                                         r"in pool 'full'"):
        pool.try_alloc_swa(_full(2, 3))
    assert pool.swa_allocator.num_free_tokens == 6


def test_try_alloc_swa_returns_none_when_swa_is_full(pool: HybridSWAPool) -> None:
    """With no SWA page free, try_alloc_swa returns None and maps nothing."""
    pool.try_alloc(6)
    extra = pool.full_allocator.try_alloc(2)
    assert pool.try_alloc_swa(extra) is None
    assert _ids(pool.swa_slots_of(extra)) == [0, 0]
    pool.free(extra)


def test_free_refuses_swa_space(pool: HybridSWAPool) -> None:
    """free takes DEVICE_FULL slots; SWA slots are refused."""
    pool.try_alloc(2)
    swa = Indices(torch.tensor([2, 3]), IndexSpace.DEVICE_SWA)
    with pytest.raises(ValueError, match=r"pool 'full' takes indices in space DEVICE_FULL, "
                                         r"got DEVICE_SWA"):
        pool.free(swa)


# ---- translation ---------------------------------------------------------------------------


def test_translate_mapped_slots(shifted: HybridSWAPool) -> None:
    """Full slots 6..9 translate to SWA slots 2..5."""
    assert _ids(shifted.translate_full_to_swa(_full(6, 7, 8, 9))) == [2, 3, 4, 5]


def test_translate_unmapped_and_padding_slots_to_zero(shifted: HybridSWAPool) -> None:
    """Slots that left the window and the padding slot 0 translate to 0."""
    assert _ids(shifted.translate_full_to_swa(_full(9, 0, 3, 6, 2))) == [5, 0, 0, 2, 0]


def test_translate_returns_int32_swa_indices(shifted: HybridSWAPool) -> None:
    """Attention kernels get int32 DEVICE_SWA indices, from int32 or int64 input."""
    for dtype in (torch.int32, torch.int64):
        out = shifted.translate_full_to_swa(_full(7, dtype=dtype))
        assert out.tensor.dtype == torch.int32
        assert out.space is IndexSpace.DEVICE_SWA
        assert _ids(out) == [3]


def test_translate_empty_input_is_empty_int32(pool: HybridSWAPool) -> None:
    """Empty in, empty int32 out."""
    out = pool.translate_full_to_swa(_full())
    assert out.tensor.shape == (0,) and out.tensor.dtype == torch.int32


def test_translate_refuses_swa_indices(shifted: HybridSWAPool) -> None:
    """Translating indices that are already SWA is refused."""
    swa = Indices(torch.tensor([2]), IndexSpace.DEVICE_SWA)
    with pytest.raises(ValueError, match=r"translate_full_to_swa: pool 'full' takes indices in "
                                         r"space DEVICE_FULL, got DEVICE_SWA"):
        shifted.translate_full_to_swa(swa)


@pytest.mark.parametrize("slot", [14, -1, -14])
def test_translate_refuses_slot_outside_full_pool(
    pool: HybridSWAPool, monkeypatch: pytest.MonkeyPatch, slot: int
) -> None:
    """With the debug flag unset, slot 14 of a 14-slot pool, -1 (which would alias the last
    slot's SWA slot) and -14 are refused, naming the pool, value and bound."""
    monkeypatch.delenv(DEBUG_CHECKS_ENV, raising=False)
    with pytest.raises(BoundsError, match=rf"translate_full_to_swa: slot {slot} is "
                                          rf"(out of range|negative) for pool 'full' "
                                          rf"\(valid slots are 0\.\.13\)"):
        pool.translate_full_to_swa(_full(3, slot))


def test_swa_slots_of_is_cpu_int64(shifted: HybridSWAPool) -> None:
    """swa_slots_of gives int64 CPU DEVICE_SWA slots, any slots (not only whole pages)."""
    out = shifted.swa_slots_of(_full(7, 3))
    assert (out.tensor.dtype, out.space, _ids(out)) == (torch.int64, IndexSpace.DEVICE_SWA,
                                                        [3, 0])


# ---- page tables ---------------------------------------------------------------------------


def _table(rows: list[list[int]], dtype: torch.dtype = torch.int32,
           space: IndexSpace = IndexSpace.DEVICE_FULL) -> PageTable:
    """A CPU page table of ``rows`` in ``space``."""
    return PageTable(torch.tensor(rows, dtype=dtype), space, PAGE_SIZE)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_translate_page_table(shifted: HybridSWAPool, dtype: torch.dtype) -> None:
    """Full pages 3, 4 become SWA pages 1, 2; padding page 0 and left-window pages become 0."""
    out = shifted.translate_page_table(_table([[3, 4, 0], [1, 2, 0], [4, 3, 1]], dtype))
    assert (out.space, out.tensor.dtype) == (IndexSpace.DEVICE_SWA, torch.int32)
    assert out.tensor.tolist() == [[1, 2, 0], [0, 0, 0], [2, 1, 0]]


@pytest.mark.parametrize("page", [4, 3, 1, 0])
def test_translate_page_table_of_one_page(shifted: HybridSWAPool, page: int) -> None:
    """A one-entry table (a one-page request's) is translated like a longer one."""
    out = shifted.translate_page_table(_table([[page]]))
    assert out.tensor.tolist() == [[{4: 2, 3: 1}.get(page, 0)]]


def test_translating_twice_is_refused(shifted: HybridSWAPool) -> None:
    """An SWA-space table (seed 003: a table translated already) is refused, not
    translated again into another request's pages."""
    swa = shifted.translate_page_table(_table([[3, 4]]))
    with pytest.raises(ValueError, match=r"already in DEVICE_SWA space; only full-space tables "
                                         r"are translated"):
        shifted.translate_page_table(swa)


def test_bare_tensor_page_table_is_refused(shifted: HybridSWAPool) -> None:
    """A bare tensor carries no space and is refused with the wrapper to use."""
    with pytest.raises(TypeError, match=r"expected a DEVICE_FULL PageTable, got Tensor"):
        shifted.translate_page_table(torch.tensor([[3, 4]]))  # type: ignore[arg-type]


def test_translate_page_table_refuses_another_page_size(shifted: HybridSWAPool) -> None:
    """A table of pages of another size names both sizes."""
    table = PageTable(torch.tensor([[3]]), IndexSpace.DEVICE_FULL, 4)
    with pytest.raises(ValueError, match=r"pages of 4 on cpu; this pool has pages of 2"):
        shifted.translate_page_table(table)


@pytest.mark.parametrize(("page", "what"), [(7, "out of range"), (-1, "negative")])
def test_translate_page_table_refuses_page_outside_full_pool(
    shifted: HybridSWAPool, page: int, what: str
) -> None:
    """Page 7 of a 7-page full pool, or -1, names the page id and the valid range."""
    with pytest.raises(BoundsError, match=rf"translate_page_table: page {page} is {what} for "
                                          rf"pool 'full' \(valid pages are 0\.\.6\)"):
        shifted.translate_page_table(_table([[3, page]]))


def test_page_table_refuses_a_float_table() -> None:
    """A float page table is refused, naming the dtype."""
    with pytest.raises(ValueError, match=r"2-D int32/int64 tensor, got torch\.float32"):
        PageTable(torch.zeros(1, 2), IndexSpace.DEVICE_FULL, PAGE_SIZE)


def test_page_slots_refuse_a_table_of_the_wrong_space(shifted: HybridSWAPool) -> None:
    """An SWA layer reads only SWA-space tables and a full layer only full-space ones."""
    full = _table([[3, 4]])
    swa = shifted.translate_page_table(full)
    assert shifted.page_slots(1, swa, 0).tensor.tolist() == [2, 3, 4, 5]
    assert shifted.page_slots(0, full, 0).tensor.tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match=r"pool 'swa' reads pages of space DEVICE_SWA, got a "
                                         r"DEVICE_FULL page table; translate it"):
        shifted.page_slots(1, full, 0)
    with pytest.raises(ValueError, match=r"pool 'full' reads pages of space DEVICE_FULL, got "
                                         r"a DEVICE_SWA page table"):
        shifted.page_slots(0, swa, 0)


def test_page_slots_refuse_a_page_outside_the_pool(shifted: HybridSWAPool) -> None:
    """A full-space table naming a page past the pool is refused when read."""
    with pytest.raises(BoundsError, match=r"page_slots: page 7 is out of range for pool 'full' "
                                          r"\(valid pages are 0\.\.6\)"):
        shifted.page_slots(0, _table([[7]]), 0)


def test_translate_empty_page_table(pool: HybridSWAPool) -> None:
    """An empty table keeps its shape and comes back int32."""
    table = PageTable(torch.empty(2, 0, dtype=torch.int64), IndexSpace.DEVICE_FULL, PAGE_SIZE)
    out = pool.translate_page_table(table).tensor
    assert out.shape == (2, 0) and out.dtype == torch.int32


# ---- CUDA-graph decode buffers -------------------------------------------------------------


def test_fill_decode_buffer_zeroes_stale_tail(shifted: HybridSWAPool) -> None:
    """A buffer holding stale locations from an earlier replay gets translated rows then 0s."""
    buffer = torch.full((6,), 5, dtype=torch.int32)
    out = shifted.fill_decode_buffer(buffer, _full(7, 6, 9))
    assert buffer.tolist() == [3, 2, 5, 0, 0, 0]
    assert out.space is IndexSpace.DEVICE_SWA
    assert out.tensor.data_ptr() == buffer.data_ptr()


def test_fill_decode_buffer_translates_unmapped_rows_to_zero(shifted: HybridSWAPool) -> None:
    """A decode row whose token has no SWA slot points at the padding slot."""
    buffer = torch.full((3,), 4, dtype=torch.int32)
    shifted.fill_decode_buffer(buffer, _full(2, 8))
    assert buffer.tolist() == [0, 4, 0]


def test_fill_decode_buffer_with_no_rows_zeroes_everything(pool: HybridSWAPool) -> None:
    """An empty batch leaves the whole buffer at the padding slot."""
    buffer = torch.full((4,), 3, dtype=torch.int32)
    pool.fill_decode_buffer(buffer, _full())
    assert buffer.tolist() == [0, 0, 0, 0]


def test_fill_decode_buffer_refuses_int64_buffer(pool: HybridSWAPool) -> None:
    """The buffer must be int32 (the second seed's int64 mismatch)."""
    buffer = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"buffer must be 1-D int32 on cpu, got torch\.int64 "
                                         r"\(4,\) on cpu"):
        pool.fill_decode_buffer(buffer, _full(2))


def test_fill_decode_buffer_of_exactly_its_length(shifted: HybridSWAPool) -> None:
    """As many locations as the buffer has rows fit it."""
    buffer = torch.full((3,), 5, dtype=torch.int32)
    shifted.fill_decode_buffer(buffer, _full(7, 6, 9))
    assert buffer.tolist() == [3, 2, 5]


def test_fill_decode_buffer_refuses_too_many_locations(shifted: HybridSWAPool) -> None:
    """Three locations do not fit a 2-row buffer; the buffer is left alone."""
    buffer = torch.full((2,), 5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"3 locations do not fit a buffer of 2"):
        shifted.fill_decode_buffer(buffer, _full(6, 7, 8))
    assert buffer.tolist() == [5, 5]


# ---- KV writes -----------------------------------------------------------------------------


def _fill_sentinel(pool: HybridSWAPool) -> None:
    """Every row of both sub-pools holds the sentinel."""
    pool.full.data.fill_(SENTINEL)
    pool.swa.data.fill_(SENTINEL)


def test_swa_layer_set_kv_writes_the_translated_rows_only(shifted: HybridSWAPool) -> None:
    """Layer 1 at full slots 6, 7 writes SWA rows 2, 3, never SWA rows 6, 7, nor the full pool."""
    _fill_sentinel(shifted)
    k, v = _kv(2, 1.0)
    shifted.set_kv(1, _full(6, 7), k, v)
    expected = torch.full_like(shifted.swa.data, SENTINEL)
    expected[0, 0, 2:4] = k.flatten(1)
    expected[1, 0, 2:4] = v.flatten(1)
    expected[:, 0, :PAGE_SIZE] = 0.0  # the whole padding page
    assert torch.equal(shifted.swa.data, expected)
    assert torch.equal(shifted.full.data, torch.full_like(shifted.full.data, SENTINEL))


def test_swa_layer_write_of_unmapped_slot_goes_to_padding(shifted: HybridSWAPool) -> None:
    """A token without SWA slot is written to the padding slot, which is then cleared."""
    _fill_sentinel(shifted)
    k, v = _kv(1, 1.0)
    shifted.set_kv(3, _full(2), k, v)
    expected = torch.full_like(shifted.swa.data, SENTINEL)
    expected[:, 1, :PAGE_SIZE] = 0.0
    assert torch.equal(shifted.swa.data, expected)


def test_full_layer_set_kv_writes_the_full_pool(shifted: HybridSWAPool) -> None:
    """Layer 2 (full layer 1) at full slots 6, 7 writes full rows 6, 7 and no SWA row."""
    _fill_sentinel(shifted)
    k, v = _kv(2, 1.0)
    shifted.set_kv(2, _full(6, 7), k, v)
    expected = torch.full_like(shifted.full.data, SENTINEL)
    expected[0, 1, 6:8] = k.flatten(1)
    expected[1, 1, 6:8] = v.flatten(1)
    expected[:, 1, :PAGE_SIZE] = 0.0
    assert torch.equal(shifted.full.data, expected)
    assert torch.equal(shifted.swa.data, torch.full_like(shifted.swa.data, SENTINEL))


def test_set_kv_refuses_swa_indices_on_swa_layer(shifted: HybridSWAPool) -> None:
    """set_kv takes DEVICE_FULL locations even for SWA layers."""
    swa = Indices(torch.tensor([2]), IndexSpace.DEVICE_SWA)
    k, v = _kv(1, 0.0)
    with pytest.raises(ValueError, match=r"set_kv\(layer=1\): pool 'full' takes indices in "
                                         r"space DEVICE_FULL, got DEVICE_SWA"):
        shifted.set_kv(1, swa, k, v)


def test_swa_buffers_read_the_rows_set_kv_wrote(shifted: HybridSWAPool) -> None:
    """key_buffer(swa layer) at the translated slots holds what set_kv wrote at full slots."""
    k, v = _kv(2, 1.0)
    locs = _full(8, 9)
    shifted.set_kv(3, locs, k, v)
    swa_locs = shifted.translate_full_to_swa(locs).tensor.long()
    assert torch.equal(shifted.key_buffer(3)[swa_locs], k)
    assert torch.equal(shifted.value_buffer(3)[swa_locs], v)


def test_forward_locs_translate_once(
    shifted: HybridSWAPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """set_kv with ForwardLocs writes the SWA rows they hold without translating again."""
    locs = shifted.forward_locs(_full(6, 7))
    assert locs.swa is not None and _ids(locs.swa) == [2, 3]
    assert (locs.swa.tensor.dtype, locs.full.tensor.dtype) == (torch.int32, torch.int64)

    def no_translation(index: torch.Tensor) -> torch.Tensor:
        raise AssertionError("set_kv translated instead of using the handle")

    monkeypatch.setattr(shifted.slot_map, "swa_of", no_translation)
    k, v = _kv(2, 1.0)
    shifted.set_kv(1, locs, k, v)
    assert torch.equal(shifted.swa.key_buffer(0)[2:4], k)


def test_refilled_buffer_writes_every_row_where_it_belongs(shifted: HybridSWAPool) -> None:
    """Seeds 000/001: an engine refills one out_cache_loc buffer in place between two
    forwards and passes the same Indices object; every SWA row of the second forward lands
    at the second batch's SWA slots and the first batch's rows stay intact."""
    buffer = torch.tensor([6, 7], dtype=torch.int32)
    locs = Indices(buffer, IndexSpace.DEVICE_FULL)
    k1, v1 = _kv(2, 1.0)
    for layer in range(4):
        shifted.set_kv(layer, locs, k1, v1)
    buffer.copy_(torch.tensor([8, 9], dtype=torch.int32))  # next batch, same object
    k2, v2 = _kv(2, 50.0)
    for layer in range(4):
        shifted.set_kv(layer, locs, k2, v2)
    for layer in (1, 3):
        assert torch.equal(shifted.key_buffer(layer)[2:4], k1)  # SWA slots of 6, 7
        assert torch.equal(shifted.key_buffer(layer)[4:6], k2)  # SWA slots of 8, 9
        assert torch.equal(shifted.value_buffer(layer)[4:6], v2)
    for layer in (0, 2):
        assert torch.equal(shifted.key_buffer(layer)[6:8], k1)
        assert torch.equal(shifted.key_buffer(layer)[8:10], k2)


def test_forward_locs_own_their_slots(shifted: HybridSWAPool) -> None:
    """Refilling the buffer ForwardLocs were made from changes neither their full nor their
    SWA slots (a new forward makes new ones)."""
    buffer = torch.tensor([6, 7], dtype=torch.int32)
    locs = shifted.forward_locs(Indices(buffer, IndexSpace.DEVICE_FULL))
    buffer.copy_(torch.tensor([8, 9], dtype=torch.int32))
    assert locs.swa is not None
    assert (_ids(locs.full), _ids(locs.swa)) == ([6, 7], [2, 3])


def test_forward_locs_after_map_change_are_refused(shifted: HybridSWAPool) -> None:
    """Once free_swa changed the map, set_kv refuses the old handle and writes nothing."""
    locs = shifted.forward_locs(_full(6, 7))
    shifted.free_swa(_full(6, 7))
    _fill_sentinel(shifted)
    before = shifted.swa.data.clone(), shifted.full.data.clone()
    k, v = _kv(2, 1.0)
    for layer in (0, 1):
        with pytest.raises(ValueError, match=r"full-to-SWA map changed after these ForwardLocs"):
            shifted.set_kv(layer, locs, k, v)
    assert torch.equal(shifted.swa.data, before[0]) and torch.equal(shifted.full.data, before[1])


def test_forward_locs_of_another_pool_are_refused(shifted: HybridSWAPool) -> None:
    """A handle made by another pool is refused."""
    other = _make_pool()
    locs = other.forward_locs(_full(6, 7))
    k, v = _kv(2, 1.0)
    with pytest.raises(ValueError, match=r"made by another pool"):
        shifted.set_kv(1, locs, k, v)


@pytest.mark.parametrize("slot", [-1, 14, -14])
def test_set_kv_refuses_slot_outside_full_pool(shifted: HybridSWAPool, slot: int) -> None:
    """Seed 004: slot -1 on an SWA layer would overwrite the last slot's SWA row (a live
    request's); -1, 14 and -14 are refused with the flag unset and nothing is written."""
    _fill_sentinel(shifted)
    before = shifted.swa.data.clone(), shifted.full.data.clone()
    k, v = _kv(2, 1.0)
    for layer in (0, 1):
        with pytest.raises(BoundsError, match=rf"set_kv\(layer={layer}\): slot {slot} is"):
            shifted.set_kv(layer, _full(6, slot), k, v)
        with pytest.raises(BoundsError, match=rf"forward_locs: slot {slot} is"):
            shifted.forward_locs(_full(6, slot))
    assert torch.equal(shifted.swa.data, before[0]) and torch.equal(shifted.full.data, before[1])


def test_set_kv_after_map_change_translates_afresh(shifted: HybridSWAPool) -> None:
    """Once free_swa unmapped the slots, set_kv with Indices writes the padding slot, not
    stale rows."""
    locs = _full(6, 7)
    shifted.free_swa(locs)
    _fill_sentinel(shifted)
    k, v = _kv(2, 1.0)
    shifted.set_kv(1, locs, k, v)
    expected = torch.full_like(shifted.swa.data, SENTINEL)
    expected[:, 0, :PAGE_SIZE] = 0.0
    assert torch.equal(shifted.swa.data, expected)


def test_accessors_and_set_kv_wait_on_the_model_layer(shifted: HybridSWAPool) -> None:
    """The waiter gets model layer ids, once per call; the sub-pools do not wait again."""
    waited: list[int] = []
    shifted.register_layer_waiter(waited.append)
    shifted.key_buffer(3)
    shifted.value_buffer(2)
    k, v = _kv(1, 0.0)
    shifted.set_kv(1, _full(6), k, v)
    assert waited == [3, 2, 1]


def test_swa_layer_key_buffer_is_the_swa_pool_view(pool: HybridSWAPool) -> None:
    """key_buffer of model layer 3 is the SWA pool's local layer 1."""
    assert pool.key_buffer(3).data_ptr() == pool.swa.data[0, 1].data_ptr()
    assert pool.key_buffer(3).shape == (8, HEADS, HEAD_DIM)


# ---- integrity -----------------------------------------------------------------------------


def _corruptible() -> HybridSWAPool:
    """A pool in the shifted state, to be corrupted (no integrity fixture)."""
    hybrid = _make_pool()
    hybrid.free_swa(hybrid.try_alloc(4))
    hybrid.try_alloc(4)
    hybrid.check_integrity()
    return hybrid


def test_integrity_detects_bogus_map_entry() -> None:
    """A map entry pointing at an SWA page nobody allocated raises RuntimeError."""
    hybrid = _corruptible()
    hybrid.slot_map.full_to_swa_host[2] = 6
    with pytest.raises(RuntimeError, match=r"swa pool: 2 pages allocated but 3 mapped"):
        hybrid.check_integrity()


def test_integrity_detects_swa_page_mapped_twice() -> None:
    """Two full pages mapping the same SWA page raise RuntimeError."""
    hybrid = _corruptible()
    hybrid.slot_map.full_to_swa_host[2:4] = [2, 3]
    with pytest.raises(RuntimeError, match=r"mapped from more than one full page"):
        hybrid.check_integrity()


def test_integrity_detects_free_full_page_still_mapped() -> None:
    """A full page freed behind the map's back raises RuntimeError."""
    hybrid = _corruptible()
    hybrid.full_allocator.free(_full(6, 7))
    with pytest.raises(RuntimeError, match=r"a free full page still maps to an SWA page"):
        hybrid.check_integrity()


def test_integrity_detects_device_map_drift() -> None:
    """A device map that differs from its host mirror raises RuntimeError."""
    hybrid = _corruptible()
    hybrid.full_to_swa[6] = 0
    with pytest.raises(RuntimeError, match=r"device map differs from its host mirror"):
        hybrid.check_integrity()


def test_integrity_checks_the_allocators() -> None:
    """A corrupted SWA allocator is caught by the pool's check."""
    hybrid = _corruptible()
    hybrid.swa_allocator._is_free[0] = True
    with pytest.raises(RuntimeError, match=r"pool 'swa': reserved page 0 is marked free"):
        hybrid.check_integrity()


def test_map_and_host_mirror_hold_the_mapping(shifted: HybridSWAPool) -> None:
    """The device map and its CPU mirror both send full 6..9 to SWA 2..5 and the rest to 0."""
    expected = np.zeros(14, dtype=np.int64)
    expected[6:10] = [2, 3, 4, 5]
    assert shifted.full_to_swa.dtype == torch.int64
    assert shifted.full_to_swa.tolist() == expected.tolist()
    assert np.array_equal(shifted.slot_map.full_to_swa_host, expected)
