"""The staged backend's plans, made once per op and reused by every layer group: bit-identical
to fresh plans, one per chunk and layer shape, never reused for another shape or chunking,
valid after the staging buffers are replaced, and held without a reference cycle."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from controller_helpers import make_controller

from hicache.controller import (
    CacheController,
    TorchBackend,
    TransferBackend,
    staged_chunk,
    staged_views,
)
from hicache.controller.base import Direction, MovedTransfer, PoolTransfer
from hicache.controller.chunk_copies import CopyTemplates
from hicache.controller.layer_blocks import BlockShape
from hicache.controller.staged import StagedBackend
from hicache.controller.staged_chunk import ChunkPlan, ChunkSlots, StagedMove
from hicache.pools import AttentionKind, HostLayout, IndexSpace, Indices, RowGeometry

LAYERS = 4
PAIRS = 21


def scattered_move(ctrl: CacheController, seed: int = 0) -> MovedTransfer:
    """``PAIRS`` pairs: host slots cut anywhere (many short runs, partial pages) and random
    device slots; random host and device rows."""
    gen = torch.Generator().manual_seed(seed)
    ctrl.host_pool.data.copy_(torch.randn(ctrl.host_pool.data.shape, generator=gen))
    ctrl.device_pool.data.copy_(torch.randn(ctrl.device_pool.data.shape, generator=gen))
    host = torch.randperm(ctrl.host_pool.num_slots - 4, generator=gen)[:PAIRS] + 4
    device = torch.randperm(ctrl.device_pool.num_slots - 1, generator=gen)[:PAIRS] + 1
    host_idx, device_idx = Indices(host, IndexSpace.HOST_FULL), Indices(device,
                                                                        IndexSpace.DEVICE_FULL)
    transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                            host_indices=host_idx, device_indices=device_idx,
                            layers=tuple(range(ctrl.device_pool.num_layers)))
    return MovedTransfer(transfer, *ctrl.move_indices(host_idx, device_idx))


def copy_groups(backend: TransferBackend, layout: HostLayout, groups: list[list[int]],
                fresh: bool = False, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Load then write ``groups`` of layers one copy each through one moved transfer (with
    ``fresh``: its plans dropped before every copy); the device and host buffers after."""
    ctrl = make_controller(backend, device=device, page_size=4, num_layers=LAYERS,
                           layout=layout)
    moved = scattered_move(ctrl)
    for direction in (Direction.HOST_TO_DEVICE, Direction.DEVICE_TO_HOST):
        for layers in groups:
            if fresh:
                moved.staged_move = None
            backend.copy(moved, layers, direction, [])
    if device != "cpu":
        torch.cuda.synchronize()
    return ctrl.device_pool.data.cpu(), ctrl.host_pool.data.clone()


@pytest.fixture
def plans_made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BlockShape]]:
    """The layer shape of every ChunkPlan made."""
    made: list[BlockShape] = []
    init = staged_chunk.ChunkPlan.__init__

    def counted(self: ChunkPlan, move: StagedMove, slots: ChunkSlots, shape: BlockShape,
                buffer: torch.Tensor, templates: CopyTemplates) -> None:
        made.append(shape)
        init(self, move, slots, shape, buffer, templates)

    monkeypatch.setattr(staged_chunk.ChunkPlan, "__init__", counted)
    yield made


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_plans_reused_across_layers_equal_fresh_plans(
        layout: HostLayout, plans_made: list[BlockShape]) -> None:
    """Layer by layer in chunks of 8 pairs, both directions: the 3 plans made for layer 0
    move layers 1..3 bit for bit as plans made afresh for each copy do, and as the torch
    backend does."""
    groups = [[layer] for layer in range(LAYERS)]
    reused = copy_groups(StagedBackend(2), layout, groups)
    assert plans_made == [((0, 1),)] * 3
    fresh = copy_groups(StagedBackend(2), layout, groups, fresh=True)
    assert len(plans_made) == 3 + 3 * 2 * LAYERS
    expected = copy_groups(TorchBackend(), layout, groups)
    for found in (reused, fresh):
        assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_other_layer_shapes_and_chunkings_get_their_own_plans(
        layout: HostLayout, plans_made: list[BlockShape]) -> None:
    """One moved transfer copied as layers [0], [1, 2], [0, 2] (two blocks), [3] and then by
    a backend of other chunks: each new layer shape or chunk size is planned anew ([3]
    reuses [0]'s plans) and every copy equals the torch backend's."""
    groups = [[0], [1, 2], [0, 2], [3]]
    ctrl = make_controller(StagedBackend(4), page_size=4, num_layers=LAYERS, layout=layout)
    reference = make_controller(TorchBackend(), page_size=4, num_layers=LAYERS, layout=layout)
    moved, expected = scattered_move(ctrl), scattered_move(reference)
    shapes = []
    for backend in (StagedBackend(4), StagedBackend(2)):  # chunks of 12 / 8, then 8 / 4
        for layers in groups:
            before = len(plans_made)
            backend.copy(moved, layers, Direction.HOST_TO_DEVICE, [])
            TorchBackend().copy(expected, layers, Direction.HOST_TO_DEVICE, [])
            shapes.append(set(plans_made[before:]))
            assert torch.equal(ctrl.device_pool.data, reference.device_pool.data), layers
    assert shapes[:4] == [{((0, 1),)}, {((0, 2),)}, {((0, 1), (1, 1))}, set()]
    assert shapes[4:] == shapes[:4]  # other chunk sizes: planned again, once per shape


def test_plans_survive_replaced_staging_buffers() -> None:
    """A pool of wider rows replaces the shared lane's buffers between two layers of another
    move; that move's plans (offsets from whichever buffer) still copy exactly."""
    backend = StagedBackend(4)
    narrow = make_controller(backend, page_size=4, num_layers=LAYERS)
    wide_row = RowGeometry(AttentionKind.MHA, 4, 8, 0, torch.float32)
    wide = make_controller(backend, page_size=4, num_layers=LAYERS, row=wide_row)
    reference = make_controller(TorchBackend(), page_size=4, num_layers=LAYERS)
    moved, other, expected = scattered_move(narrow), scattered_move(wide), scattered_move(
        reference)
    backend.copy(moved, [0], Direction.HOST_TO_DEVICE, [])
    small = backend.allocated_bytes()
    backend.copy(other, [0], Direction.HOST_TO_DEVICE, [])
    assert backend.allocated_bytes() > small  # replaced by larger buffers
    backend.copy(moved, [1], Direction.HOST_TO_DEVICE, [])
    TorchBackend().copy(expected, [0, 1], Direction.HOST_TO_DEVICE, [])
    assert torch.equal(narrow.device_pool.data, reference.device_pool.data)


def test_a_lane_is_allocated_once_for_every_op_it_fits() -> None:
    """Ops of the same pool in both directions, and of a pool of narrower rows, reuse the
    staging buffers the first op allocated; only a wider one replaces them."""
    backend = StagedBackend(4)
    narrow_row = RowGeometry(AttentionKind.MHA, 4, 2, 0, torch.float32)
    ctrl = make_controller(backend, page_size=4, num_layers=LAYERS)
    narrow = make_controller(backend, page_size=4, num_layers=LAYERS, row=narrow_row)
    backend.copy(scattered_move(ctrl), range(LAYERS), Direction.DEVICE_TO_HOST, [])
    (lane,) = backend._lanes.values()
    first = [buffer.data_ptr() for buffer in lane.buffers]
    backend.copy(scattered_move(ctrl, seed=1), [0], Direction.HOST_TO_DEVICE, [])
    backend.copy(scattered_move(narrow), range(LAYERS), Direction.DEVICE_TO_HOST, [])
    (same,) = backend._lanes.values()
    assert same is lane and [buffer.data_ptr() for buffer in lane.buffers] == first


def test_staged_move_holds_no_reference_cycle() -> None:
    """A moved transfer with its plans is freed when its op lets go of it, without waiting
    for the cycle collector (its indices and staging temporaries go with it)."""
    ctrl = make_controller(StagedBackend(4), page_size=4, num_layers=LAYERS)
    moved = scattered_move(ctrl)
    StagedBackend(4).copy(moved, [0], Direction.HOST_TO_DEVICE, [])
    assert moved.staged_move is not None
    gone = weakref.ref(moved)
    gc.disable()
    try:
        del moved
        assert gone() is None
    finally:
        gc.enable()



@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_ops_between_one_pool_pair_share_its_views(layout: HostLayout) -> None:
    """Three ops of other slots between the same pools, each loaded and written layer group by
    layer group: every op reads the same :class:`PoolViews` and layer groups (made once),
    each moves exactly what the torch backend moves, and the backend lets go of the views
    once the pools are gone."""
    backend = StagedBackend(4)
    ctrl = make_controller(backend, page_size=4, num_layers=LAYERS, layout=layout)
    reference = make_controller(TorchBackend(), page_size=4, num_layers=LAYERS, layout=layout)
    seen_views, seen_groups = set(), set()
    for seed in (0, 1, 2):
        moved, expected = scattered_move(ctrl, seed), scattered_move(reference, seed)
        for direction in (Direction.HOST_TO_DEVICE, Direction.DEVICE_TO_HOST):
            for layers in ([0], [1, 2], [3]):
                backend.copy(moved, layers, direction, [])
                TorchBackend().copy(expected, layers, direction, [])
                assert moved.staged_move is not None
                seen_views.add(id(moved.staged_move.views))
                seen_groups.add(id(moved.staged_move.views.group(tuple(layers))))
        assert torch.equal(ctrl.device_pool.data, reference.device_pool.data)
        assert torch.equal(ctrl.host_pool.data, reference.host_pool.data)
    assert len(seen_views) == 1 and len(seen_groups) == 3
    assert len(backend._views) == 1
    del ctrl, moved
    gc.collect()
    assert len(backend._views) == 0


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_chunks_of_one_length_share_their_staging_views(layout: HostLayout) -> None:
    """Writes and loads of all layers in chunks of 4 pairs, two ops of other slots: the lane's
    buffers hold one set of views per chunk length (4 pairs, and the last chunk's 1), not
    one per chunk or op, and every op moves what the torch backend moves."""
    backend = StagedBackend(4)
    ctrl = make_controller(backend, page_size=4, num_layers=LAYERS, layout=layout)
    reference = make_controller(TorchBackend(), page_size=4, num_layers=LAYERS, layout=layout)
    for seed in (0, 1):
        moved, expected = scattered_move(ctrl, seed), scattered_move(reference, seed)
        for direction in (Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE):
            backend.copy(moved, list(range(LAYERS)), direction, [])
            TorchBackend().copy(expected, list(range(LAYERS)), direction, [])
        assert torch.equal(ctrl.device_pool.data, reference.device_pool.data)
        assert torch.equal(ctrl.host_pool.data, reference.host_pool.data)
    (lane,) = backend._lanes.values()
    lengths = {key[0] for buffer in lane.staging for key in buffer._views
               if isinstance(key[0], int)}
    per_pair = ctrl.device_pool.geometry.num_components * LAYERS * (
        ctrl.device_pool.geometry.row_elems)
    assert lengths == {4 * per_pair, (PAIRS % 4) * per_pair}


def test_bounded_view_caches_still_move_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for two views per staging buffer and two layer groups per pool pair, ops
    of several chunk lengths and layer groups empty the caches again and again and every op
    still moves what the torch backend moves; the caches never hold more than their bound."""
    monkeypatch.setattr(staged_views, "MAX_VIEWS", 2)
    monkeypatch.setattr(staged_views, "MAX_GROUPS", 2)
    backend = StagedBackend(4)
    ctrl = make_controller(backend, page_size=4, num_layers=LAYERS,
                           layout=HostLayout.PAGE_FIRST_DIRECT)
    reference = make_controller(TorchBackend(), page_size=4, num_layers=LAYERS,
                                layout=HostLayout.PAGE_FIRST_DIRECT)
    for seed in (0, 1, 2):
        moved, expected = scattered_move(ctrl, seed), scattered_move(reference, seed)
        for direction in (Direction.HOST_TO_DEVICE, Direction.DEVICE_TO_HOST):
            for layers in ([0], [1, 2], [0, 1, 2, 3], [3]):
                backend.copy(moved, layers, direction, [])
                TorchBackend().copy(expected, layers, direction, [])
                assert moved.staged_move is not None
                assert len(moved.staged_move.views._groups) <= 2
        assert torch.equal(ctrl.device_pool.data, reference.device_pool.data)
        assert torch.equal(ctrl.host_pool.data, reference.host_pool.data)
    (lane,) = backend._lanes.values()
    assert all(len(buffer._views) <= 2 for buffer in lane.staging)


def test_a_closed_host_pool_is_refused_and_its_buffer_not_kept() -> None:
    """The views a backend keeps for a pool pair hold no host buffer: once the ops that read
    it are gone and the pool is closed, its memory goes, and a new op between the pools is
    refused with the pool's own error, as before any op was made."""
    backend = StagedBackend(4)
    ctrl = make_controller(backend, page_size=4, num_layers=LAYERS)
    moved, later = scattered_move(ctrl, 0), scattered_move(ctrl, 1)
    backend.copy(moved, [0, 1], Direction.HOST_TO_DEVICE, [])
    buffer = weakref.ref(ctrl.host_pool.data)
    del moved
    ctrl.host_pool.close()
    gc.collect()
    assert buffer() is None and len(backend._views) == 1
    with pytest.raises(RuntimeError, match="is closed"):
        backend.copy(later, [0], Direction.HOST_TO_DEVICE, [])
    assert later.staged_move is None


@pytest.mark.parametrize("dtype, width, widened", [
    (torch.bfloat16, 4, True), (torch.bfloat16, 8, True), (torch.bfloat16, 6, False),
    (torch.bfloat16, 3, False), (torch.float32, 2, True), (torch.float32, 3, False),
    (torch.uint8, 16, True), (torch.uint8, 12, False), (torch.float64, 2, False),
])
def test_rows_widen_to_8_byte_elements_only_where_whole(dtype: torch.dtype, width: int,
                                                        widened: bool) -> None:
    """Staging rows are moved as int64 where each row is a whole number of 8 bytes (same
    bits, fewer elements); other rows, and rows of 8-byte elements already, stay as they
    are."""
    rows = torch.arange(3 * width, dtype=torch.float32).to(dtype).view(3, width)
    found = staged_views.wide(rows)
    if widened:
        assert found.dtype is torch.int64
        assert found.shape == (3, width * rows.element_size() // 8)
        assert torch.equal(found.view(dtype), rows)
    else:
        assert found is rows
