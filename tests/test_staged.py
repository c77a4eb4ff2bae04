"""The staged backend's chunking and run logic on a CPU (plain copies stand in for the copy
engine): chunk edges, host runs, layouts, per-layer moves and sentinels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from controller_helpers import SENTINEL, device_rows, host_rows, make_controller, untouched
from test_controller import round_trip

from hicache.controller import (
    CacheController,
    TorchBackend,
    TransferBackend,
    chunk_slots,
    copy2d,
    load_groups,
    staged_chunk,
)
from hicache.controller.base import Direction, MovedTransfer, PoolTransfer
from hicache.controller.chunk_slots import host_runs
from hicache.controller.copy2d import Copy2D
from hicache.controller.staged import StagedBackend
from hicache.pools import AttentionKind, HostLayout, IndexSpace, Indices, RowGeometry

CHUNK = 8


@pytest.mark.parametrize("num_tokens", [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_chunk_edges(num_tokens: int, layout: HostLayout) -> None:
    """Token counts around the chunk size move exactly; untouched rows keep the sentinel."""
    ctrl = make_controller(StagedBackend(CHUNK), page_size=1, layout=layout)
    ctrl.device_allocator.try_alloc(5)
    device = ctrl.device_allocator.try_alloc(num_tokens)
    assert device is not None
    order = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(num_tokens))
    round_trip(ctrl, Indices(device.tensor[order], IndexSpace.DEVICE_FULL))


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_fragmented_host_slots(layout: HostLayout) -> None:
    """Host slots in many short runs (a fragmented free list) still move exactly."""
    ctrl = make_controller(StagedBackend(CHUNK), page_size=2, layout=layout,
                           kind=AttentionKind.MLA)
    host = ctrl.host_pool.allocator
    held = [host.try_alloc(2) for _ in range(12)]
    for part in held[::2]:
        assert part is not None
        host.free(part)
    device = ctrl.device_allocator.try_alloc(12)
    assert device is not None
    round_trip(ctrl, device)


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_non_consecutive_layers_equal_torch(layout: HostLayout) -> None:
    """A move of layers 0 and 2 only (two layer blocks) writes exactly the rows the torch
    backend writes, in both directions; layer 1 keeps the sentinel."""
    results = []
    for backend in (TorchBackend(), StagedBackend(CHUNK)):
        ctrl = make_controller(backend, page_size=1, layout=layout, num_layers=3)
        device = ctrl.device_allocator.try_alloc(2 * CHUNK + 1)
        host = ctrl.host_pool.allocator.try_alloc(2 * CHUNK + 1)
        assert device is not None and host is not None
        transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool,
                                device_pool=ctrl.device_pool, host_indices=host,
                                device_indices=device, layers=(0, 1, 2))
        moved = MovedTransfer(transfer, *ctrl.move_indices(host, device))
        backend.copy(moved, [0, 2], Direction.DEVICE_TO_HOST, [])
        ctrl.device_pool.data.fill_(SENTINEL)
        backend.copy(moved, [0, 2], Direction.HOST_TO_DEVICE, [])
        results.append((device_rows(ctrl.device_pool), host_rows(ctrl.host_pool)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    host_after, device_after = results[1][1], results[1][0]
    assert (host_after[:, :, 1] == SENTINEL).all() and (host_after[:, :, 0] != SENTINEL).any()
    assert (device_after[:, :, 1] == SENTINEL).all() and (device_after[:, :, 2] != SENTINEL).any()


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda x: x.value)
def test_fragmented_round_trip_equals_torch(layout: HostLayout, kind: AttentionKind) -> None:
    """Pages in random order into a host pool with holes, back layer by layer: the same
    device and host rows as the torch backend."""
    expected = fragmented_round_trip(TorchBackend(), layout, kind, "cpu")
    found = fragmented_round_trip(StagedBackend(6), layout, kind, "cpu")
    assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])


def fragmented_round_trip(backend: TransferBackend, layout: HostLayout, kind: AttentionKind,
                          device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Write 20 random pages of 40 into a host pool with holes, reload them layer by layer;
    the final device and host rows."""
    ctrl: CacheController = make_controller(
        backend, device=device, page_size=2, device_pages=64, host_pages=120, num_layers=5,
        layout=layout, kind=kind, dtype=torch.bfloat16)
    rows = torch.randn(ctrl.device_pool.data.shape, generator=torch.Generator().manual_seed(3))
    ctrl.device_pool.data.copy_(rows)
    host_alloc = ctrl.host_pool.allocator
    held = [host_alloc.try_alloc(2 * (1 + i % 3)) for i in range(24)]
    for part in held[::2]:
        assert part is not None
        host_alloc.free(part)
    slots = ctrl.device_allocator.try_alloc(80)
    assert slots is not None
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    moved = Indices(slots.tensor.view(-1, 2)[order[:20]].flatten(), IndexSpace.DEVICE_FULL)
    host = ctrl.write(moved)
    assert host is not None
    ctrl.start_writing()
    ctrl.drain()
    ctrl.evict_device(moved)
    ctrl.device_pool.data.fill_(SENTINEL)
    loaded = ctrl.load(host)
    assert loaded is not None
    ctrl.start_loading()
    ctrl.drain()
    if device != "cpu":
        torch.cuda.synchronize()
    return device_rows(ctrl.device_pool).cpu(), host_rows(ctrl.host_pool).clone()


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_rows_not_a_multiple_of_eight_bytes(layout: HostLayout) -> None:
    """6-byte rows (no 8-byte view for the gather and scatter) move exactly too."""
    row = RowGeometry(AttentionKind.MLA, 1, 1, 3, torch.float16)
    ctrl = make_controller(StagedBackend(CHUNK), page_size=1, layout=layout, row=row)
    device = ctrl.device_allocator.try_alloc(2 * CHUNK + 1)
    assert device is not None
    round_trip(ctrl, device)


def test_pairs_sorted_by_host_slot() -> None:
    """order_pairs sorts by host slot and permutes device slots alike."""
    host, device = StagedBackend().order_pairs(torch.tensor([9, 3, 5]), torch.tensor([1, 2, 3]))
    assert host.tolist() == [3, 5, 9] and device.tolist() == [2, 3, 1]


def test_pair_order_is_stable_and_sorted_pairs_stay() -> None:
    """A host slot named twice (a merged load) keeps its pairs in order; pairs already sorted
    (the allocator's runs, a repeat included) come back as they are."""
    backend = StagedBackend()
    host, device = backend.order_pairs(torch.tensor([7, 2, 7, 2]), torch.tensor([1, 2, 3, 4]))
    assert host.tolist() == [2, 2, 7, 7] and device.tolist() == [2, 4, 1, 3]
    sorted_host, sorted_device = torch.tensor([2, 3, 3, 8]), torch.tensor([5, 6, 7, 8])
    same = backend.order_pairs(sorted_host, sorted_device)
    assert same[0] is sorted_host and same[1] is sorted_device
    empty = torch.empty(0, dtype=torch.int64)
    assert backend.order_pairs(empty, empty)[0].numel() == 0


def test_host_runs() -> None:
    """Consecutive host slots form one run; gaps start new runs."""
    assert host_runs(np.array([4, 5, 6, 9, 10, 20])) == [(0, 3), (3, 2), (5, 1)]
    assert host_runs(np.array([], dtype=np.int64)) == []


def test_staging_is_bounded() -> None:
    """Staging memory is two chunks of token rows (the budget and one host page, here of
    one token), whatever the op size."""
    backend = StagedBackend(CHUNK)
    ctrl = make_controller(backend, page_size=1, num_layers=3)
    device = ctrl.device_allocator.try_alloc(3 * CHUNK + 1)
    assert device is not None
    ctrl.write(device)
    ctrl.drain()
    token_bytes = ctrl.device_pool.geometry.token_bytes(3)
    expected = 2 * (CHUNK + 1) * token_bytes
    assert backend.allocated_bytes() == backend.staging_bytes(token_bytes, 1) == expected


def test_rejects_bad_chunk() -> None:
    """A staging size below one token is refused."""
    with pytest.raises(ValueError, match="staging_tokens must be >= 1"):
        StagedBackend(0)


def test_write_leaves_other_host_rows() -> None:
    """A staged write touches only the host slots it was given."""
    ctrl = make_controller(StagedBackend(CHUNK))
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    host = ctrl.write(device)
    ctrl.drain()
    assert host is not None
    assert (untouched(host_rows(ctrl.host_pool), host.tensor) == SENTINEL).all()


def test_layer_wise_chunks_use_the_whole_budget() -> None:
    """A one-layer move of a 3-layer pool takes three times the tokens per chunk."""
    backend = StagedBackend(CHUNK)
    assert backend.chunk_tokens(pool_layers=3, moved_layers=3, num_pairs=30 * CHUNK) == CHUNK
    assert backend.chunk_tokens(pool_layers=3, moved_layers=1,
                                num_pairs=30 * CHUNK) == 3 * CHUNK


def test_chunks_are_balanced_whole_pages_within_the_buffer() -> None:
    """A 32k-token move of 3 of 32 layers with a budget of 1024 tokens: three chunks of
    whole 16-token pages (10928 tokens), not 10922 and a fourth of 2; every chunk, for any
    op size and layer count, fits the budget plus one page of every layer, and the chunks
    cover the op in the fewest the budget allows."""
    backend = StagedBackend(1024)
    assert backend.chunk_tokens(pool_layers=32, moved_layers=3, num_pairs=32768,
                                page_size=16) == 10928
    for page_size in (1, 16, 64):
        for moved in (1, 2, 3, 5, 32):
            for pairs in (1, 15, 16, 1000, 10922 * 3 + 16, 32768, 100_000):
                chunk = backend.chunk_tokens(32, moved, pairs, page_size)
                assert chunk % page_size == 0
                assert chunk * moved <= (1024 + page_size) * 32
                fewest = -(-pairs * moved // (1024 * 32))
                assert -(-pairs // chunk) == fewest


def per_layer_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer-wise loads copy every layer on its own: each layer above the byte bound, slow
    to move, no copy-count bound (controller/load_groups.py)."""
    monkeypatch.setattr(load_groups, "GROUP_BYTES", 1)
    monkeypatch.setattr(load_groups, "MAX_COPIES", 1024)
    monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1.0)


def issued_copies(monkeypatch: pytest.MonkeyPatch) -> list[Copy2D]:
    """Record every planned 2D copy a staged move issues on the CPU, and still copy."""
    issued: list[Copy2D] = []
    emulate = copy2d.emulate_copies

    def record(copies: list[Copy2D], host: torch.Tensor, host_offset: int,
               staged: torch.Tensor, to_host: bool) -> None:  # bytes of both buffers
        issued.extend(copies)
        emulate(copies, host, host_offset, staged, to_host)

    monkeypatch.setattr(copy2d, "emulate_copies", record)
    return issued


def test_page_first_direct_layer_of_a_page_run_is_one_2d_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer-wise load of 4 consecutive whole 16-slot pages copies each layer as ONE 2D
    copy: 4 pages x K,V rows of 16 token rows, a layer-major page block apart on the host;
    the write of all layers is one contiguous copy."""
    per_layer_loads(monkeypatch)
    ctrl = make_controller(StagedBackend(64), page_size=16, num_layers=3, layout=HostLayout
                           .PAGE_FIRST_DIRECT, device_pages=8, host_pages=8)
    copies = issued_copies(monkeypatch)
    device = ctrl.device_allocator.try_alloc(64)
    assert device is not None
    round_trip(ctrl, device)
    row_bytes = ctrl.device_pool.geometry.row_bytes
    page_bytes = 16 * 2 * 3 * row_bytes
    write, *loads = copies
    assert write[5] == 1 and write[4] == 4 * page_bytes
    assert len(loads) == 3
    for _, host_pitch, _, staged_pitch, width, height in loads:
        assert (height, width, host_pitch, staged_pitch) == (
            8, 16 * row_bytes, 3 * 16 * row_bytes, 16 * row_bytes)


def test_page_first_direct_partial_pages_copy_only_their_slots() -> None:
    """Host slots cut mid-page (2 slots of page 1, all of page 2, 3 of page 3) write only
    those slots; the rest of each page keeps the sentinel."""
    ctrl = make_controller(StagedBackend(CHUNK), page_size=4, num_layers=2,
                           layout=HostLayout.PAGE_FIRST_DIRECT)
    host = Indices(torch.tensor([6, 7, 8, 9, 10, 11, 12, 13, 14]), IndexSpace.HOST_FULL)
    device = Indices(torch.arange(20, 29), IndexSpace.DEVICE_FULL)
    transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                            host_indices=host, device_indices=device, layers=(0, 1))
    moved = MovedTransfer(transfer, *ctrl.move_indices(host, device))
    ctrl.backend.copy(moved, [0, 1], Direction.DEVICE_TO_HOST, [])
    rows = host_rows(ctrl.host_pool)
    assert torch.equal(rows[host.tensor], device_rows(ctrl.device_pool)[device.tensor])
    assert (untouched(rows, host.tensor) == SENTINEL).all()


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_layer_wise_load_plans_each_chunk_once(monkeypatch: pytest.MonkeyPatch,
                                               layout: HostLayout) -> None:
    """A 6-layer load copied layer by layer (two chunks per layer) derives each chunk's host
    runs or pages once for the op, not once per layer."""
    made: list[tuple[int, int]] = []
    init = staged_chunk.ChunkSlots.__init__

    def counted(self: staged_chunk.ChunkSlots, moved: MovedTransfer, start: int,
                end: int, op: chunk_slots.OpSlots) -> None:
        made.append((start, end))
        init(self, moved, start, end, op)

    ctrl = make_controller(StagedBackend(CHUNK), page_size=2, layout=layout, num_layers=6)
    # a budget of 6 * CHUNK tokens of one layer: two balanced chunks of 3 * CHUNK + 2
    device = ctrl.device_allocator.try_alloc(CHUNK * 6 + 4)
    assert device is not None
    host = ctrl.write(device)
    assert host is not None
    ctrl.drain()
    monkeypatch.setattr(staged_chunk.ChunkSlots, "__init__", counted)
    per_layer_loads(monkeypatch)
    assert ctrl.load(host) is not None  # 6 layers: one group per layer
    ctrl.drain()
    assert made == [(0, 3 * CHUNK + 2), (3 * CHUNK + 2, 6 * CHUNK + 4)]


def test_chunk_runs_cut_from_the_op_breaks_equal_the_chunk_own() -> None:
    """An op's run breaks are found once and each chunk's runs cut from them: for random
    sorted slots with runs of every length and random chunks (empty, one slot, on a break,
    between breaks, the whole op), the same runs as splitting the chunk's own slots."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        lengths = rng.integers(1, 6, size=rng.integers(1, 12))
        gaps = rng.integers(1, 4, size=lengths.size)
        slots = np.concatenate([np.arange(start, start + length) for start, length in
                                zip(np.cumsum(lengths + gaps) - lengths, lengths, strict=True)])
        breaks = chunk_slots.run_breaks(slots)
        for start, end in [(0, slots.size), (0, 0), *(sorted(rng.integers(0, slots.size + 1,
                                                                        size=2))
                                                       for _ in range(5))]:
            assert chunk_slots.runs_between(breaks, int(start), int(end)) == \
                host_runs(slots[start:end]), (slots, start, end)


def test_op_holds_the_staging_buffers_once() -> None:
    """Per-layer copies of one op add the lane's two staging buffers to its tensors once,
    not once per layer (each is recorded on the side stream when the op is issued)."""
    backend = StagedBackend(CHUNK)
    ctrl = make_controller(backend, num_layers=4)
    device = ctrl.device_allocator.try_alloc(3 * CHUNK)
    host = ctrl.host_pool.allocator.try_alloc(3 * CHUNK)
    assert device is not None and host is not None
    transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                            host_indices=host, device_indices=device, layers=(0, 1, 2, 3))
    moved = MovedTransfer(transfer, *ctrl.move_indices(host, device))
    keep_alive: list[torch.Tensor] = []
    for layer in range(4):
        backend.copy(moved, [layer], Direction.HOST_TO_DEVICE, keep_alive)
    assert len(keep_alive) == 2
    assert {t.data_ptr() for t in keep_alive} == {b.data_ptr() for b in
                                                  next(iter(backend._lanes.values())).buffers}
