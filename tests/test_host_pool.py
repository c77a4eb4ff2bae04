"""HostKVPool: every layout holds the same rows, storage order, close, refused inputs (CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hicache.pools import (
    AttentionKind,
    HostKVPool,
    HostLayout,
    IndexSpace,
    Indices,
    RowGeometry,
    as_layer_first,
)

HEADS, HEAD_DIM, LATENT = 2, 2, 6
NUM_LAYERS, NUM_PAGES, PAGE_SIZE = 3, 4, 2  # slots 0..9
NUM_SLOTS = (NUM_PAGES + 1) * PAGE_SIZE
MHA = RowGeometry(AttentionKind.MHA, HEADS, HEAD_DIM, 0, torch.bfloat16)
MLA = RowGeometry(AttentionKind.MLA, 0, 0, LATENT, torch.bfloat16)
SLOTS = [7, 2, 5]


def _pool(layout: HostLayout, geometry: RowGeometry = MHA, page_size: int = PAGE_SIZE,
          num_pages: int = NUM_PAGES) -> HostKVPool:
    """An unpinned 3-layer host pool named 'h' with 4 pages of 2 slots (by default)."""
    return HostKVPool(
        name="h", space=IndexSpace.HOST_FULL, num_layers=NUM_LAYERS, num_pages=num_pages,
        page_size=page_size, geometry=geometry, layout=layout, pin=False,
    )


def _host(*slots: int, dtype: torch.dtype = torch.int64) -> Indices:
    """HOST_FULL indices of ``slots``."""
    return Indices(torch.tensor(slots, dtype=dtype), IndexSpace.HOST_FULL)


def _rows(n: int, geometry: RowGeometry = MHA, seed: int = 0) -> torch.Tensor:
    """``n`` random rows ``[n, components, layers, row_elems]`` in the pool dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n, geometry.num_components, NUM_LAYERS, geometry.row_elems)
    return torch.randn(shape, generator=gen).to(geometry.dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, dtype-agnostic)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(params=list(HostLayout), ids=lambda layout: layout.value)
def pool(request: pytest.FixtureRequest) -> Iterator[HostKVPool]:
    """An MHA host pool in each layout, closed after the test."""
    host = _pool(request.param)
    yield host
    host.close()


# ---- layouts -------------------------------------------------------------------------------


def test_every_layout_reads_back_the_same_rows() -> None:
    """Rows written to a pool of each layout read back byte-identical."""
    rows = _rows(len(SLOTS))
    for layout in HostLayout:
        host = _pool(layout)
        host.write_rows(_host(*SLOTS), rows)
        assert _same_bytes(host.read_rows(_host(*SLOTS)), rows), layout


def test_layer_rows_of_strided_layouts_hold_the_written_rows() -> None:
    """layer_rows(component, layer)[slot] is the row written for that slot (layer_first,
    page_first)."""
    rows = _rows(len(SLOTS))
    for layout in (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST):
        host = _pool(layout)
        host.write_rows(_host(*SLOTS), rows)
        for i, slot in enumerate(SLOTS):
            for component in range(2):
                for layer in range(NUM_LAYERS):
                    got = host.layer_rows(component, layer)[slot]
                    assert _same_bytes(got, rows[i, component, layer]), (layout, slot)


def test_layer_pages_of_every_layout_hold_the_written_rows(pool: HostKVPool) -> None:
    """layer_pages(component, layer)[slot // page_size, slot % page_size] is the row written
    for that slot, and read_layer_rows gives the same rows."""
    rows = _rows(len(SLOTS))
    pool.write_rows(_host(*SLOTS), rows)
    slots = torch.tensor(SLOTS)
    for component in range(2):
        for layer in range(NUM_LAYERS):
            pages = pool.layer_pages(component, layer)
            assert pages.shape == (NUM_SLOTS // PAGE_SIZE, PAGE_SIZE, HEADS * HEAD_DIM)
            for i, slot in enumerate(SLOTS):
                got = pages[slot // PAGE_SIZE, slot % PAGE_SIZE]
                assert _same_bytes(got, rows[i, component, layer]), (pool.layout, slot)
            assert _same_bytes(pool.read_layer_rows(component, layer, slots),
                               rows[:, component, layer])


def test_write_layer_rows_writes_one_layer_only(pool: HostKVPool) -> None:
    """write_layer_rows changes exactly the given slots of one component and layer."""
    rows = _rows(len(SLOTS))[:, 1, 2]
    pool.write_layer_rows(1, 2, torch.tensor(SLOTS), rows)
    everything = pool.read_rows(_host(*range(NUM_SLOTS)))
    assert _same_bytes(everything[SLOTS, 1, 2], rows)
    everything[SLOTS, 1, 2] = 0
    assert not everything.any()


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_as_layer_first_of_every_layout(page_size: int) -> None:
    """as_layer_first(data, layout)[c, l, s] is the row of slot s, component c, layer l."""
    num_slots = 3 * page_size
    rows = _rows(num_slots - page_size, seed=page_size)
    for layout in HostLayout:
        host = _pool(layout, page_size=page_size, num_pages=2)
        host.write_rows(_host(*range(page_size, num_slots)), rows)
        canonical = as_layer_first(host.data, layout)
        assert canonical.shape == (2, NUM_LAYERS, num_slots, HEADS * HEAD_DIM)
        assert _same_bytes(canonical[:, :, page_size:], rows.permute(1, 2, 0, 3)), layout


def test_write_leaves_other_rows_untouched(pool: HostKVPool) -> None:
    """Only the written slots change; every other row stays zero."""
    pool.write_rows(_host(*SLOTS), _rows(len(SLOTS)))
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(pool.read_rows(_host(*others)),
                       torch.zeros(len(others), 2, NUM_LAYERS, HEADS * HEAD_DIM,
                                   dtype=MHA.dtype))


def test_layer_rows_shape() -> None:
    """layer_rows is [num_slots, row_elems] in layer_first and page_first."""
    for layout in (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST):
        assert _pool(layout).layer_rows(1, 2).shape == (NUM_SLOTS, HEADS * HEAD_DIM)


def test_layer_first_storage_order() -> None:
    """layer_first data is [components, layers, slots, row]; a layer's rows are contiguous."""
    host = _pool(HostLayout.LAYER_FIRST)
    rows = _rows(1)
    host.write_rows(_host(4), rows)
    assert host.data.shape == (2, NUM_LAYERS, NUM_SLOTS, HEADS * HEAD_DIM)
    assert _same_bytes(host.data[1, 2, 4], rows[0, 1, 2])
    assert host.layer_rows(1, 2).is_contiguous()


def test_page_first_storage_order() -> None:
    """page_first data is [slots, components, layers, row]; a slot's layers are contiguous."""
    host = _pool(HostLayout.PAGE_FIRST)
    rows = _rows(1)
    host.write_rows(_host(4), rows)
    assert host.data.shape == (NUM_SLOTS, 2, NUM_LAYERS, HEADS * HEAD_DIM)
    assert _same_bytes(host.data[4], rows[0])
    assert host.data[4].is_contiguous()
    assert not host.layer_rows(1, 2).is_contiguous()


def test_page_first_direct_storage_order() -> None:
    """page_first_direct data is [pages, components, layers, page_size, row]: a page is one
    contiguous block, one layer of one component of it page_size consecutive rows."""
    host = _pool(HostLayout.PAGE_FIRST_DIRECT)
    rows = _rows(2)
    host.write_rows(_host(4, 5), rows)
    assert host.data.shape == (NUM_PAGES + 1, 2, NUM_LAYERS, PAGE_SIZE, HEADS * HEAD_DIM)
    assert _same_bytes(host.data[2], rows.permute(1, 2, 0, 3))
    assert host.data[2].is_contiguous() and host.data[2, 1, 2].is_contiguous()
    assert not host.layer_pages(1, 2).is_contiguous()


def test_page_first_direct_with_page_size_1_is_page_first() -> None:
    """With one-token pages, page_first_direct holds the same bytes as page_first."""
    rows = _rows(len(SLOTS))
    buffers = []
    for layout in (HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT):
        host = _pool(layout, page_size=1, num_pages=NUM_SLOTS - 1)
        host.write_rows(_host(*SLOTS), rows)
        buffers.append(host.data.reshape(-1))
    assert _same_bytes(buffers[0], buffers[1])


def test_page_first_direct_refuses_layer_rows() -> None:
    """A page_first_direct layer is no single 2-D view: layer_rows says what to use."""
    host = _pool(HostLayout.PAGE_FIRST_DIRECT)
    with pytest.raises(ValueError, match=r"layer_rows: host pool 'h' has layout "
                                         r"page_first_direct.*use layer_pages"):
        host.layer_rows(0, 0)


def test_layer_pages_is_a_view(pool: HostKVPool) -> None:
    """Writing through layer_pages is visible to read_rows (transfer engines write there)."""
    row = torch.arange(HEADS * HEAD_DIM).to(MHA.dtype)
    pool.layer_pages(0, 1)[3, 0] = row
    assert torch.equal(pool.read_rows(_host(6))[0, 0, 1], row)


def test_mla_pool_has_one_component() -> None:
    """An MLA host pool stores one latent row per slot and layer, and round-trips it."""
    for layout in HostLayout:
        host = _pool(layout, MLA)
        rows = _rows(2, MLA, seed=1)
        host.write_rows(_host(3, 8), rows)
        assert host.data.shape[0 if layout is HostLayout.LAYER_FIRST else 1] == 1
        assert host.layer_pages(0, 2).shape == (NUM_SLOTS // PAGE_SIZE, PAGE_SIZE, LATENT)
        assert _same_bytes(host.read_rows(_host(3, 8)), rows)
        assert _same_bytes(host.layer_pages(0, 2)[4, 0], rows[1, 0, 2])


def test_size_bytes_counts_every_slot(pool: HostKVPool) -> None:
    """size_bytes is slots x token bytes, including the reserved page."""
    assert pool.size_bytes == NUM_SLOTS * MHA.token_bytes(NUM_LAYERS)


def test_allocator_hands_out_host_slots(pool: HostKVPool) -> None:
    """The pool's allocator gives HOST_FULL slots from page 1 on."""
    got = pool.allocator.try_alloc(4)
    assert got is not None and got.tensor.tolist() == [2, 3, 4, 5]
    assert got.space is IndexSpace.HOST_FULL
    pool.allocator.free(got)
    pool.allocator.check_integrity()


def test_unpinned_pool_reports_unpinned(pool: HostKVPool) -> None:
    """pin=False leaves the buffer pageable."""
    assert not pool.is_pinned


# ---- inputs --------------------------------------------------------------------------------


def test_int32_indices_read_and_write(pool: HostKVPool) -> None:
    """int32 host indices work like int64 ones."""
    rows = _rows(2)
    pool.write_rows(_host(9, 1, dtype=torch.int32), rows)
    assert _same_bytes(pool.read_rows(_host(9, 1, dtype=torch.int32)), rows)


def test_empty_read_and_write(pool: HostKVPool) -> None:
    """Empty indices read an empty [0, c, l, r] tensor and write nothing."""
    pool.write_rows(_host(), _rows(0))
    assert pool.read_rows(_host()).shape == (0, 2, NUM_LAYERS, HEADS * HEAD_DIM)
    assert not pool.data.any()


def test_device_space_indices_raise(pool: HostKVPool) -> None:
    """DEVICE_FULL indices are refused, naming the pool and both spaces."""
    device = Indices(torch.tensor([2]), IndexSpace.DEVICE_FULL)
    with pytest.raises(ValueError, match=r"read_rows: pool 'h' takes indices in space "
                                         r"HOST_FULL, got DEVICE_FULL"):
        pool.read_rows(device)
    with pytest.raises(ValueError, match=r"write_rows: pool 'h' takes indices in space "
                                         r"HOST_FULL, got DEVICE_FULL"):
        pool.write_rows(device, _rows(1))


def test_write_rows_refuses_wrong_shape(pool: HostKVPool) -> None:
    """Rows of the wrong shape name the expected dtype and shape and the given ones."""
    with pytest.raises(ValueError, match=r"write_rows on host pool 'h': expected "
                                         r"torch\.bfloat16 rows of shape \(2, 2, 3, 4\), "
                                         r"got torch\.bfloat16 \(1, 2, 3, 4\)"):
        pool.write_rows(_host(2, 3), _rows(1))


def test_write_rows_refuses_wrong_dtype(pool: HostKVPool) -> None:
    """float32 rows for a bfloat16 pool are refused."""
    with pytest.raises(ValueError, match=r"got torch\.float32 \(1, 2, 3, 4\)"):
        pool.write_rows(_host(2), _rows(1).float())


def test_device_space_is_refused_at_construction() -> None:
    """A host pool cannot be built in a device index space."""
    with pytest.raises(ValueError, match=r"host pool 'h' cannot use device space DEVICE_FULL"):
        HostKVPool(name="h", space=IndexSpace.DEVICE_FULL, num_layers=1, num_pages=1,
                   page_size=2, geometry=MHA, layout=HostLayout.LAYER_FIRST, pin=False)


# ---- close ---------------------------------------------------------------------------------


def test_close_makes_later_access_raise(pool: HostKVPool) -> None:
    """After close, data, layer_pages, read_rows and write_rows raise naming the pool."""
    pool.close()
    with pytest.raises(RuntimeError, match=r"host pool 'h' is closed"):
        _ = pool.data
    with pytest.raises(RuntimeError, match=r"host pool 'h' is closed"):
        pool.layer_pages(0, 0)
    with pytest.raises(RuntimeError, match=r"host pool 'h' is closed"):
        pool.read_rows(_host(2))
    with pytest.raises(RuntimeError, match=r"host pool 'h' is closed"):
        pool.write_rows(_host(2), _rows(1))


def test_close_is_idempotent(pool: HostKVPool) -> None:
    """A second close does nothing."""
    pool.close()
    pool.close()
    assert not pool.is_pinned
