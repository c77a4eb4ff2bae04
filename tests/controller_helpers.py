"""Builders shared by the controller tests: small pools, recognisable rows, sentinel checks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import pytest
import torch

from hicache.controller import (
    CacheController,
    Direction,
    HybridCacheController,
    HybridSlots,
    KernelBackend,
    TorchBackend,
    TransferBackend,
    op_issue,
)
from hicache.controller.base import MovedTransfer
from hicache.controller.core import TransferCore
from hicache.controller.direct import DirectBackend
from hicache.controller.kernel import kernel_available
from hicache.controller.staged import StagedBackend
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    HybridSWAPool,
    IndexSpace,
    Indices,
    PageAllocator,
    RowGeometry,
    as_layer_first,
)

SENTINEL = -7.0


def gpu_backends() -> list[TransferBackend]:
    """Every backend a GPU test runs (``kernel`` where Triton is there); staged chunks of 16
    tokens, so small moves take several."""
    found: list[TransferBackend] = [TorchBackend(), StagedBackend(staging_tokens=16),
                                    DirectBackend()]
    if kernel_available():
        found.append(KernelBackend(num_programs=16))
    return found


def check_layer_by_layer(ctrl: CacheController, target: Indices, rows: torch.Tensor,
                         forward: torch.cuda.Stream) -> None:
    """On ``forward``, wait for each layer of the latest load (``wait_until``) and read
    ``target``'s rows of it: every layer must equal ``rows`` (``[n, components, layers,
    row]``), never a stale value."""
    index = target.tensor.cuda()
    seen = []
    with torch.cuda.stream(forward):
        for layer in range(ctrl.num_layers):
            ctrl.wait_until(layer)
            seen.append(ctrl.device_pool.data[:, layer, index].clone())
    forward.synchronize()
    for layer, got in enumerate(seen):
        assert torch.equal(got.permute(1, 0, 2).cpu(), rows[:, :, layer]), layer


class CallOrder(TorchBackend):
    """The torch backend, noting each copy call's direction and model layers in issue order
    (a hybrid op's copies each cover one pool's layers; a plain pool's are its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Direction, tuple[int, ...]]] = []

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        layers = moved.source.layers
        self.calls.append((direction, tuple(layers[local] for local in local_layers)))
        super().copy(moved, local_layers, direction, keep_alive)


def on_each_gpu_backend_and_layout(test: Callable[..., None]) -> Callable[..., None]:
    """Mark ``test`` for the GPU (skipped without CUDA) and run it for every backend of
    :func:`gpu_backends` (``backend``) on the ``layer_first`` and ``page_first_direct``
    host layouts (``layout``)."""
    marks = [pytest.mark.gpu,
             pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
             pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name),
             pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST,
                                                HostLayout.PAGE_FIRST_DIRECT],
                                     ids=lambda layout: layout.value)]
    for mark in reversed(marks):
        test = mark(test)
    return test


def start_together(ctrl: TransferCore, calls: list[tuple[Direction, tuple[int, ...]]],
                   monkeypatch: pytest.MonkeyPatch, write_issue_s: float) -> int:
    """``start_transfers()`` with ``calls`` (a recording backend's copy calls) cleared and
    the write's issue taken to last ``write_issue_s``: it starts both and consumes the load's
    event set. Returns the position of the write's first copy call in ``calls``."""
    monkeypatch.setattr(op_issue, "WRITE_ISSUE_S_PER_BYTE", 0.0)
    monkeypatch.setattr(op_issue, "WRITE_ISSUE_S", write_issue_s)
    calls.clear()
    set_id = ctrl.start_transfers()
    assert set_id is not None and ctrl.layer_events.consumer == set_id
    return [direction for direction, _ in calls].index(Direction.DEVICE_TO_HOST)


def geometry(kind: AttentionKind = AttentionKind.MHA, dtype: torch.dtype = torch.float32
             ) -> RowGeometry:
    """2 heads x 4 dims (MHA) or a 12-wide latent row (MLA)."""
    return RowGeometry(kind, 2, 4, 12, dtype)


def make_controller(
    backend: TransferBackend,
    *,
    device: str = "cpu",
    page_size: int = 1,
    device_pages: int = 80,
    host_pages: int = 160,
    num_layers: int = 3,
    kind: AttentionKind = AttentionKind.MHA,
    layout: HostLayout = HostLayout.LAYER_FIRST,
    dtype: torch.dtype = torch.float32,
    row: RowGeometry | None = None,
) -> CacheController:
    """A controller over fresh pools; device rows hold unique values, host rows the sentinel.
    ``row`` replaces the default geometry (``kind`` and ``dtype`` are then ignored)."""
    geo = row if row is not None else geometry(kind, dtype)
    allocator = PageAllocator(device_pages, page_size, IndexSpace.DEVICE_FULL, "full")
    device_pool = DeviceKVPool(
        name="full", space=IndexSpace.DEVICE_FULL, num_layers=num_layers,
        num_slots=allocator.num_slots, geometry=geo, device=device,
    )
    host_pool = HostKVPool(
        name="full", space=IndexSpace.HOST_FULL, num_layers=num_layers, num_pages=host_pages,
        page_size=page_size, geometry=geo, layout=layout,
    )
    fill_unique(device_pool.data)
    host_pool.data.fill_(SENTINEL)
    return CacheController(
        device_pool=device_pool, device_allocator=allocator, host_pool=host_pool,
        backend=backend,
    )


def make_hybrid(
    backend: TransferBackend,
    *,
    device: str = "cpu",
    page_size: int = 2,
    full_pages: int = 16,
    swa_pages: int = 10,
    host_pages: int = 40,
    layout: HostLayout = HostLayout.LAYER_FIRST,
    num_layers: int = 4,
    swa_layers: Sequence[int] = (1, 3),
) -> HybridCacheController:
    """``num_layers`` model layers (4), ``swa_layers`` sliding-window (1 and 3)."""
    geo = geometry()
    pool = HybridSWAPool(
        num_layers=num_layers, swa_layers=list(swa_layers), full_pages=full_pages,
        swa_pages=swa_pages, page_size=page_size, geometry=geo, device=device,
    )
    hosts = [
        HostKVPool(name=name, space=space, num_layers=layers, num_pages=host_pages,
                   page_size=page_size, geometry=geo, layout=layout)
        for name, space, layers in (
            ("full", IndexSpace.HOST_FULL, num_layers - len(swa_layers)),
            ("swa", IndexSpace.HOST_SWA, len(swa_layers)))
    ]
    fill_unique(pool.full.data)
    fill_unique(pool.swa.data, offset=0.5)
    for host in hosts:
        host.data.fill_(SENTINEL)
    return HybridCacheController(
        hybrid_pool=pool, host_full=hosts[0], host_swa=hosts[1], backend=backend,
    )


def fill_unique(data: torch.Tensor, offset: float = 0.0) -> None:
    """Give every element a distinct value (exact in float32 for small pools)."""
    values = torch.arange(data.numel(), dtype=torch.float64) + offset + 1
    data.copy_(values.view(data.shape).to(data.dtype))


def host_rows(host: HostKVPool) -> torch.Tensor:
    """All rows as ``[slots, components, layers, row]`` regardless of layout."""
    return as_layer_first(host.data, host.layout).permute(2, 0, 1, 3).cpu().clone()


def device_rows(pool: DeviceKVPool) -> torch.Tensor:
    """All rows as ``[slots, components, layers, row]``."""
    return pool.data.permute(2, 0, 1, 3).cpu().clone()


def untouched(rows: torch.Tensor, touched: torch.Tensor) -> torch.Tensor:
    """Rows whose slot is not in ``touched``."""
    mask = torch.ones(rows.shape[0], dtype=torch.bool)
    mask[touched.cpu()] = False
    return rows[mask]


class BackedUp(NamedTuple):
    """What :func:`back_up_and_evict` leaves: the device slots written (now freed), their
    host copies, their SWA slots before the eviction (0 outside the window) and the full and
    SWA device rows as they were."""

    full: Indices
    host: HybridSlots
    swa_before: torch.Tensor
    full_rows: torch.Tensor
    swa_rows: torch.Tensor


def back_up_and_evict(ctrl: HybridCacheController, num_tokens: int, no_swa_tokens: int
                      ) -> BackedUp:
    """On a fresh hybrid controller: allocate ``num_tokens`` after a 4-token padding
    allocation, drop the SWA slots of the first ``no_swa_tokens``, write everything to the
    host, evict the device copy and fill both device pools with :data:`SENTINEL`."""
    pool = ctrl.hybrid_pool
    assert pool.try_alloc(4) is not None
    full = pool.try_alloc(num_tokens)
    assert full is not None
    pool.free_swa(Indices(full.tensor[:no_swa_tokens], IndexSpace.DEVICE_FULL))
    swa_before = pool.swa_slots_of(full).tensor
    full_rows, swa_rows = device_rows(pool.full)[full.tensor], device_rows(pool.swa)
    host = ctrl.write(full)
    assert host is not None
    ctrl.drain()
    ctrl.evict_device(full)
    pool.full.data.fill_(SENTINEL)
    pool.swa.data.fill_(SENTINEL)
    return BackedUp(full, host, swa_before, full_rows, swa_rows)


def written_and_wiped(ctrl: CacheController, num_tokens: int) -> tuple[Indices, torch.Tensor]:
    """Write ``num_tokens`` device rows, evict them and wipe the device pool; return the host
    slots and the rows (``[n, components, layers, row]``) a load must bring back."""
    ctrl.device_allocator.try_alloc(3 * ctrl.device_allocator.page_size)  # ids differ
    device = ctrl.device_allocator.try_alloc(num_tokens)
    assert device is not None
    rows = device_rows(ctrl.device_pool)[device.tensor]
    host = ctrl.write(device)
    assert host is not None
    ctrl.drain()
    ctrl.evict_device(device)
    ctrl.device_pool.data.fill_(SENTINEL)
    return host, rows
