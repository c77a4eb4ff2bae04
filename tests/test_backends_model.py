"""Every CPU-runnable backend against a plain reference copy of the pools, over random ops.

A seeded driver fragments both allocators, then takes steps of: one or two writes and up to
three loads (merged into one op each; loads may name a host page twice), issued one
direction after the other or together (``start_transfers``), by slot-copying calls or with
the caller's page ids (``*_without_copies``), in every page order (ascending, reversed,
shuffled, runs in random order); then evictions and new device contents. After each step
the whole host and device pools must equal a reference that applies the same moves with
plain indexing, nothing may be left in flight, and both allocators pass their checks.
Layer-wise loads are cut into per-layer groups by shrinking the group plan's byte bound
(on a CPU it otherwise plans layer 0 and the rest). The staged backend runs with chunks
that are not page multiples; page sizes include odd ones.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from controller_helpers import SENTINEL, fill_unique, geometry

from hicache.controller import CacheController, TorchBackend, TransferBackend, load_groups
from hicache.controller.direct import DirectBackend
from hicache.controller.staged import StagedBackend
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    IndexSpace,
    Indices,
    PageAllocator,
    as_layer_first,
)

BACKENDS: dict[str, Callable[[], TransferBackend]] = {
    "torch": TorchBackend, "staged-3": lambda: StagedBackend(3),
    "staged-37": lambda: StagedBackend(37), "direct": DirectBackend}


def host_rows(host: HostKVPool) -> torch.Tensor:
    return as_layer_first(host.data, host.layout).permute(2, 0, 1, 3).clone()


def device_rows(pool: DeviceKVPool) -> torch.Tensor:
    return pool.data.permute(2, 0, 1, 3).clone()


def slots_of(pages: list[int], page_size: int) -> np.ndarray:
    return (np.asarray(pages, dtype=np.int64)[:, None] * page_size
            + np.arange(page_size)).reshape(-1)


def arranged(rng: np.random.Generator, pages: list[int]) -> list[int]:
    """``pages`` ascending, reversed, shuffled, or as runs in random order."""
    pages = sorted(pages)
    mode = int(rng.integers(4))
    if mode == 1:
        pages.reverse()
    elif mode == 2:
        rng.shuffle(pages)
    elif mode == 3:
        cuts = sorted(rng.choice(len(pages) + 1, size=min(3, len(pages) + 1), replace=False))
        parts = [pages[a:b] for a, b in zip([0, *cuts], [*cuts, len(pages)], strict=True)]
        rng.shuffle(parts)
        pages = [page for part in parts for page in part]
    return pages


def pick(rng: np.random.Generator, pool: list[int], most: int) -> list[int]:
    """Up to ``most`` pages taken out of ``pool`` at random."""
    count = int(rng.integers(1, min(len(pool), most) + 1))
    return [pool.pop(int(i)) for i in sorted(rng.choice(len(pool), count, replace=False),
                                              reverse=True)]


def build(backend: TransferBackend, layout: HostLayout, page_size: int, kind: AttentionKind,
          num_layers: int, device_pages: int, host_pages: int) -> CacheController:
    allocator = PageAllocator(device_pages, page_size, IndexSpace.DEVICE_FULL, "full")
    device = DeviceKVPool(name="full", space=IndexSpace.DEVICE_FULL, num_layers=num_layers,
                          num_slots=allocator.num_slots, geometry=geometry(kind), device="cpu")
    host = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=num_layers,
                      num_pages=host_pages, page_size=page_size, geometry=geometry(kind),
                      layout=layout)
    fill_unique(device.data)
    host.data.fill_(SENTINEL)
    return CacheController(device_pool=device, device_allocator=allocator, host_pool=host,
                           backend=backend, event_ring_size=3)


def run(backend: TransferBackend, layout: HostLayout, page_size: int, kind: AttentionKind,
        num_layers: int, seed: int, *, steps: int = 5, most: int = 8) -> None:
    rng = np.random.default_rng(seed)
    pages = max(24, 600 // page_size)
    ctrl = build(backend, layout, page_size, kind, num_layers, pages, 2 * pages)
    device_alloc, host_alloc = ctrl.device_allocator, ctrl.host_pool.allocator
    device_ref, host_ref = device_rows(ctrl.device_pool), host_rows(ctrl.host_pool)
    owned: list[int] = []  # device pages holding rows
    while (got := device_alloc.try_alloc(int(rng.integers(1, 4)) * page_size)) is not None:
        owned += sorted(set((got.tensor.numpy() // page_size).tolist()))
    dropped = pick(rng, owned, len(owned) // 3 + 1)
    device_alloc.free(Indices(torch.from_numpy(slots_of(sorted(dropped), page_size)),
                              IndexSpace.DEVICE_FULL))
    held = [host_alloc.try_alloc(int(rng.integers(1, 4)) * page_size) for _ in range(4)]
    for got in held[::2]:
        if got is not None:
            host_alloc.free(got)
    backed: list[int] = []  # host pages holding a backup
    for step in range(steps):
        by_pages = bool(rng.integers(2))
        writes, loads = [], []
        free_owned = list(owned)
        for _ in range(int(rng.integers(1, 3))):
            if not free_owned:
                break
            chosen = arranged(rng, pick(rng, free_owned, most))
            device = Indices(torch.from_numpy(slots_of(chosen, page_size)),
                             IndexSpace.DEVICE_FULL)
            host = (ctrl.write_without_copies(device, np.asarray(chosen)) if by_pages
                    else ctrl.write(device))
            if host is not None:
                writes.append((device.tensor.numpy().copy(), host.tensor.numpy().copy()))
        for _ in range(int(rng.integers(0, 4)) if backed else 0):
            chosen = arranged(rng, pick(rng, list(backed), most))
            host = Indices(torch.from_numpy(slots_of(chosen, page_size)), IndexSpace.HOST_FULL)
            device = (ctrl.load_without_copies(host, np.asarray(chosen)) if by_pages
                      else ctrl.load(host))
            if device is not None:
                loads.append((host.tensor.numpy().copy(), device.tensor.numpy().copy()))
        if rng.integers(2):
            ctrl.start_transfers()
        else:
            ctrl.start_writing()
            ctrl.start_loading()
        ctrl.poll()
        assert ctrl.num_in_flight == 0
        for device_slots, host_slots in writes:
            host_ref[torch.from_numpy(host_slots)] = device_ref[torch.from_numpy(device_slots)]
            backed += sorted(set((host_slots // page_size).tolist()))
        for host_slots, device_slots in loads:
            device_ref[torch.from_numpy(device_slots)] = host_ref[torch.from_numpy(host_slots)]
            owned += sorted(set((device_slots // page_size).tolist()))
        for name, got, want in (("host", host_rows(ctrl.host_pool), host_ref),
                                ("device", device_rows(ctrl.device_pool), device_ref)):
            differ = (got != want).reshape(got.shape[0], -1).any(1).nonzero().flatten()
            assert not differ.numel(), f"step {step}: {name} rows differ at slots " \
                f"{differ.tolist()[:16]}"
        if backed and rng.integers(2):
            gone = pick(rng, backed, len(backed))
            ctrl.evict_host(Indices(torch.from_numpy(slots_of(sorted(gone), page_size)),
                                    IndexSpace.HOST_FULL))
        if owned and rng.integers(2):
            gone = pick(rng, owned, len(owned))
            ctrl.evict_device(Indices(torch.from_numpy(slots_of(sorted(gone), page_size)),
                                      IndexSpace.DEVICE_FULL))
        got = device_alloc.try_alloc(int(rng.integers(1, 4)) * page_size)
        if got is not None:  # new rows in the pages it hands out
            rows = torch.randn(device_ref[got.tensor].shape)
            ctrl.device_pool.data[:, :, got.tensor] = rows.permute(1, 2, 0, 3)
            device_ref = device_rows(ctrl.device_pool)
            owned += sorted(set((got.tensor.numpy() // page_size).tolist()))
    device_alloc.check_integrity()
    host_alloc.check_integrity()


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda layout: layout.value)
@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda kind: kind.value)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_backend_moves_the_rows_a_plain_copy_moves(
        name: str, kind: AttentionKind, layout: HostLayout, page_size: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    seed = sum(map(ord, name + kind.value + layout.value)) + page_size
    if seed % 2:  # a group per layer or two: the layer-wise path of every backend
        monkeypatch.setattr(load_groups, "GROUP_BYTES", 1)
        monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1e3)
    run(BACKENDS[name](), layout, page_size, kind, 3 if seed % 3 else 9, seed)
