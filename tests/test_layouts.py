"""Every backend in every host layout against a plain reference copy, on a CPU (the kernel in
the Triton interpreter): page sizes 1, 16 and 64, MHA and MLA, writes of all layers and
layer-wise loads through the controller, partial pages and layer subsets through the backend
itself, and a merged load that reads one host page twice."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import (
    SENTINEL,
    device_rows,
    host_rows,
    make_controller,
    make_hybrid,
    untouched,
)
from test_controller import backends

from hicache.controller import CacheController, TransferBackend
from hicache.controller.base import Direction, MovedTransfer, PoolTransfer
from hicache.controller.staged import StagedBackend
from hicache.pools import AttentionKind, HostLayout, IndexSpace, Indices

PAGE_SIZES = [1, 16, 64]
LAYERS = 3


def all_backends() -> list[TransferBackend]:
    """The controller tests' backends, plus a staged one whose chunks hold whole pages of
    every page size here (its page_first_direct staging then permutes instead of indexing)."""
    return [*backends(), StagedBackend(staging_tokens=128)]


def backend_id(backend: TransferBackend) -> str:
    if isinstance(backend, StagedBackend):
        return f"staged-{backend.staging_tokens}"
    return backend.name


def controller(backend: TransferBackend, layout: HostLayout, page_size: int,
               kind: AttentionKind = AttentionKind.MHA, device: str = "cpu") -> CacheController:
    """Pools of 12 device and 24 host pages of ``page_size`` slots, 3 layers."""
    return make_controller(backend, device=device, page_size=page_size, device_pages=12,
                           host_pages=24, num_layers=LAYERS, layout=layout, kind=kind)


def fragment_host(ctrl: CacheController) -> None:
    """Leave holes in the host allocator: pages 1, 3, 4 and 7 stay taken."""
    page = ctrl.host_pool.page_size
    taken = [ctrl.host_pool.allocator.try_alloc(page) for _ in range(8)]
    for i, part in enumerate(taken):
        assert part is not None
        if i not in (0, 2, 3, 6):
            ctrl.host_pool.allocator.free(part)


def random_pages(ctrl: CacheController, count: int, seed: int) -> Indices:
    """``count`` whole device pages in random order (the other pages stay free)."""
    page = ctrl.device_allocator.page_size
    slots = ctrl.device_allocator.try_alloc(ctrl.device_allocator.capacity_tokens)
    assert slots is not None
    order = torch.randperm(slots.tensor.numel() // page, generator=torch.Generator()
                           .manual_seed(seed))
    pages = slots.tensor.view(-1, page)
    ctrl.device_allocator.free(Indices(pages[order[count:]].flatten(), IndexSpace.DEVICE_FULL))
    return Indices(pages[order[:count]].flatten(), IndexSpace.DEVICE_FULL)


@pytest.mark.parametrize("backend", all_backends(), ids=backend_id)
@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda x: x.value)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_write_then_layer_wise_load(backend: TransferBackend, layout: HostLayout,
                                    page_size: int, kind: AttentionKind) -> None:
    """5 random device pages written (all layers, one op) into a fragmented host pool, then
    loaded back layer by layer: the host and device rows equal a plain copy of the source
    rows; every other row keeps the sentinel."""
    write_then_layer_wise_load(backend, layout, page_size, kind, "cpu")


def write_then_layer_wise_load(backend: TransferBackend, layout: HostLayout, page_size: int,
                               kind: AttentionKind, device: str) -> None:
    """The body of :func:`test_write_then_layer_wise_load`, on pools on ``device``."""
    ctrl = controller(backend, layout, page_size, kind, device)
    fragment_host(ctrl)
    source = random_pages(ctrl, 5, seed=page_size)
    before = device_rows(ctrl.device_pool)
    host = ctrl.write(source)
    assert host is not None
    ctrl.start_writing()
    ctrl.drain()
    if device != "cpu":
        torch.cuda.synchronize()
    rows = host_rows(ctrl.host_pool)
    assert torch.equal(rows[host.tensor], before[source.tensor])
    assert (untouched(rows, host.tensor) == SENTINEL).all()
    ctrl.evict_device(source)
    ctrl.device_pool.data.fill_(SENTINEL)
    loaded = ctrl.load(host)
    assert loaded is not None
    ctrl.start_loading()
    ctrl.drain()
    if device != "cpu":
        torch.cuda.synchronize()
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[loaded.tensor], before[source.tensor])
    assert (untouched(after, loaded.tensor) == SENTINEL).all()


@pytest.mark.parametrize("backend", all_backends(), ids=backend_id)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_partial_pages_and_a_layer_subset(backend: TransferBackend, layout: HostLayout,
                                          page_size: int) -> None:
    """Arbitrary host slots (pages cut anywhere) and layers 0 and 2 only, both directions,
    through the backend itself: exactly the reference rows move."""
    ctrl = controller(backend, layout, page_size)
    gen = torch.Generator().manual_seed(page_size)
    num_slots = ctrl.host_pool.num_slots
    count = min(3 * page_size + 5, num_slots // 2)
    host = torch.randperm(num_slots - page_size, generator=gen)[:count] + page_size
    device = torch.randperm(ctrl.device_pool.num_slots - 1, generator=gen)[:count] + 1
    host_idx = Indices(host, IndexSpace.HOST_FULL)
    device_idx = Indices(device, IndexSpace.DEVICE_FULL)
    transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                            host_indices=host_idx, device_indices=device_idx,
                            layers=tuple(range(LAYERS)))
    moved = MovedTransfer(transfer, *ctrl.move_indices(host_idx, device_idx))
    source = device_rows(ctrl.device_pool)
    backend.copy(moved, [0, 2], Direction.DEVICE_TO_HOST, [])
    moved_layers = torch.tensor([True, False, True]).view(1, 1, LAYERS, 1)
    want = torch.full_like(host_rows(ctrl.host_pool), SENTINEL)
    want[host] = torch.where(moved_layers, source[device], want[host])
    assert torch.equal(host_rows(ctrl.host_pool), want)
    ctrl.device_pool.data.fill_(SENTINEL)
    backend.copy(moved, [0, 2], Direction.HOST_TO_DEVICE, [])
    got = device_rows(ctrl.device_pool)
    expected = torch.full_like(got, SENTINEL)
    expected[device] = want[host]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", all_backends(), ids=backend_id)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_merged_load_reads_a_host_page_twice(backend: TransferBackend,
                                             layout: HostLayout) -> None:
    """Two loads of the same host pages, merged into one op, fill both device copies."""
    ctrl = controller(backend, layout, page_size=16)
    source = random_pages(ctrl, 2, seed=5)
    before = device_rows(ctrl.device_pool)
    host = ctrl.write(source)
    assert host is not None
    ctrl.start_writing()
    ctrl.drain()
    ctrl.evict_device(source)
    ctrl.device_pool.data.fill_(SENTINEL)
    first, second = ctrl.load(host), ctrl.load(host)
    assert first is not None and second is not None
    ctrl.start_loading()
    ctrl.drain()
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[first.tensor], before[source.tensor])
    assert torch.equal(after[second.tensor], before[source.tensor])


@pytest.mark.parametrize("backend", all_backends(), ids=backend_id)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_hybrid_round_trip(backend: TransferBackend, layout: HostLayout) -> None:
    """A hybrid (SWA) write, evict and load restores the full rows and the SWA tail in every
    layout: the SWA host pool takes the same layout as the full one."""
    ctrl = make_hybrid(backend, layout=layout)
    pool = ctrl.hybrid_pool
    assert pool.try_alloc(4) is not None
    full = pool.try_alloc(10)
    assert full is not None
    pool.free_swa(Indices(full.tensor[:6], IndexSpace.DEVICE_FULL))
    swa_before = pool.swa_slots_of(full).tensor
    full_rows = device_rows(pool.full)[full.tensor]
    swa_rows = device_rows(pool.swa)
    host = ctrl.write(full)
    assert host is not None
    ctrl.start_writing()
    ctrl.drain()
    ctrl.evict_device(full)
    pool.full.data.fill_(SENTINEL)
    pool.swa.data.fill_(SENTINEL)
    back = ctrl.load(host.full, host.swa, swa_tail_tokens=4)
    assert back is not None
    ctrl.start_loading()
    ctrl.drain()
    tail = back.swa.tensor != 0
    assert torch.equal(device_rows(pool.full)[back.full.tensor], full_rows)
    assert torch.equal(device_rows(pool.swa)[back.swa.tensor[tail]], swa_rows[swa_before[tail]])
    pool.check_integrity()
