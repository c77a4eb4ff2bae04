"""A staged load of whole ``page_first_direct`` host pages into whole device pages scatters
page by page (one index entry a page); any other device slots take the slot-by-slot store.
Both leave exactly the loaded rows changed (CPU pools: plain copies stand in for the copy
engine)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from controller_helpers import device_rows, make_controller, untouched

from hicache.controller import CacheController, direct_staging
from hicache.controller.base import Direction, MovedTransfer, PoolTransfer
from hicache.controller.direct_staging import device_pages
from hicache.controller.index_moves import move_checked
from hicache.controller.staged import StagedBackend
from hicache.pools import HostLayout, IndexSpace, Indices

PAGE = 4


def slots(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_device_pages_of_whole_pages_in_order() -> None:
    """Groups of a page's slots in order, pages in any order, give their page ids."""
    found = device_pages(slots(8, 9, 10, 11, 4, 5, 6, 7, 20, 21, 22, 23), PAGE, 40)
    assert found is not None and found.tolist() == [2, 1, 5]


@pytest.mark.parametrize("device_slots", [
    slots(6, 7, 8, 9),  # a page's worth that straddles two pages
    slots(8, 10, 9, 11),  # one page, out of order
    slots(8, 9, 10, 11, 12, 13),  # not whole pages
    slots(8, 9, 10, 10),  # a slot twice
    slots(),  # nothing
], ids=["straddling", "out-of-order", "partial", "repeated", "empty"])
def test_device_pages_refuses_other_slots(device_slots: np.ndarray) -> None:
    """Anything but whole pages in slot order gives ``None`` (the slot-by-slot store)."""
    assert device_pages(device_slots, PAGE, 40) is None


def test_device_pages_refuses_a_pool_of_partial_pages() -> None:
    """A pool whose slots are not whole pages of this size cannot be viewed page by page."""
    assert device_pages(slots(8, 9, 10, 11), PAGE, 42) is None


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the whole-page gathers and scatters, by device page and by device slot."""
    counts = {}
    for name in ("gather_device_pages", "gather_pages", "scatter_device_pages",
                 "scatter_pages"):
        counts[name] = 0
        method = getattr(direct_staging.DirectStaging, name)

        def counted(*args: object, name: str = name, method: Any = method) -> None:
            counts[name] += 1
            method(*args)

        monkeypatch.setattr(direct_staging.DirectStaging, name, counted)
    return counts


def direct_controller(num_layers: int = 3) -> CacheController:
    """A ``page_first_direct`` controller whose staging holds 4 pages of every layer."""
    return make_controller(StagedBackend(4 * PAGE), page_size=PAGE, num_layers=num_layers,
                           layout=HostLayout.PAGE_FIRST_DIRECT, device_pages=40, host_pages=40)


def test_whole_pages_move_by_page(calls: dict[str, int]) -> None:
    """A write of 12 allocated device pages and its load back (3 chunks of 4 pages each)
    gather and scatter page by page, and bring back exactly the written rows; every other
    device row is untouched."""
    ctrl = direct_controller()
    written = ctrl.device_allocator.try_alloc(12 * PAGE)
    assert written is not None
    rows = device_rows(ctrl.device_pool)[written.tensor].clone()
    host = ctrl.write(written)
    assert host is not None
    ctrl.drain()
    before = device_rows(ctrl.device_pool).clone()
    loaded = ctrl.load(host)
    assert loaded is not None
    ctrl.drain()
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[loaded.tensor], rows)
    assert torch.equal(untouched(after, loaded.tensor), untouched(before, loaded.tensor))
    assert calls == {"gather_device_pages": 3, "gather_pages": 0,  # all layers, 3 chunks
                     "scatter_device_pages": 3, "scatter_pages": 0}


@pytest.mark.parametrize(("host_slots", "device_slots"), [
    (list(range(8, 16)), list(range(42, 50))),  # device pages straddled
    (list(range(8, 16)), [47, 46, 45, 44, 51, 50, 49, 48]),  # device slots reversed
    (list(range(12, 16)) + list(range(8, 12)), list(range(44, 52))),  # reordered pairs
], ids=["straddling", "reversed", "reordered"])
def test_other_device_slots_move_by_slot(calls: dict[str, int], host_slots: list[int],
                                        device_slots: list[int]) -> None:
    """Whole host pages written from and loaded into device slots that are not whole pages
    in order, or whose pairs the backend reorders (host pages out of order: the op's own
    order no longer holds), move slot by slot: the rows land at exactly those slots, the
    rest of the device pool is untouched."""
    ctrl = direct_controller(num_layers=2)
    device = Indices(torch.tensor(device_slots), IndexSpace.DEVICE_FULL)
    host = Indices(torch.tensor(host_slots), IndexSpace.HOST_FULL)  # host pages 2 and 3
    rows = device_rows(ctrl.device_pool)[device.tensor].clone()
    move(ctrl, host, device, Direction.DEVICE_TO_HOST)
    for layer in range(2):  # wipe the device rows, then load them back
        for component in range(2):
            ctrl.device_pool.layer_rows(component, layer)[device.tensor] = 0
    before = device_rows(ctrl.device_pool).clone()
    assert (before[device.tensor] == 0).all()
    move(ctrl, host, device, Direction.HOST_TO_DEVICE)
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[device.tensor], rows)
    assert torch.equal(untouched(after, device.tensor), untouched(before, device.tensor))
    assert calls == {"gather_device_pages": 0, "gather_pages": 1,
                     "scatter_device_pages": 0, "scatter_pages": 1}


def test_whole_pages_of_a_move_in_order_move_by_page(calls: dict[str, int]) -> None:
    """The same move with whole device pages in order (pairs kept as the op holds them)
    gathers and scatters page by page."""
    ctrl = direct_controller(num_layers=2)
    device = Indices(torch.arange(44, 52), IndexSpace.DEVICE_FULL)
    host = Indices(torch.arange(8, 16), IndexSpace.HOST_FULL)
    rows = device_rows(ctrl.device_pool)[device.tensor].clone()
    move(ctrl, host, device, Direction.DEVICE_TO_HOST)
    for layer in range(2):
        for component in range(2):
            ctrl.device_pool.layer_rows(component, layer)[device.tensor] = 0
    move(ctrl, host, device, Direction.HOST_TO_DEVICE)
    assert torch.equal(device_rows(ctrl.device_pool)[device.tensor], rows)
    assert calls == {"gather_device_pages": 1, "gather_pages": 0,
                     "scatter_device_pages": 1, "scatter_pages": 0}


def move(ctrl: CacheController, host: Indices, device: Indices, direction: Direction) -> None:
    """Move both layers of the pairs ``(host, device)`` through the staged backend, as an
    op moves its own index tensors (``move_checked`` of owned indices: the same tensors
    when no pair drops and the host slots are sorted, else reordered copies)."""
    transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                            host_indices=host, device_indices=device, layers=(0, 1))
    moved = MovedTransfer(transfer, *move_checked(host.tensor, device.tensor, ctrl.host_pool,
                                                  ctrl.device_pool, ctrl.backend, owned=True))
    ctrl.backend.copy(moved, [0, 1], direction, [])


def test_merged_loads_of_whole_pages_move_by_page(calls: dict[str, int]) -> None:
    """Two loads queued before one ``start_loading`` (one merged op, host pages ascending
    across the two, each into its own allocation) scatter page by page and bring back each
    load's rows at its own device slots."""
    ctrl = direct_controller(num_layers=2)
    first = ctrl.device_allocator.try_alloc(2 * PAGE)
    second = ctrl.device_allocator.try_alloc(3 * PAGE)
    assert first is not None and second is not None
    rows = [device_rows(ctrl.device_pool)[slots.tensor].clone() for slots in (first, second)]
    hosts = [ctrl.write(first), ctrl.write(second)]
    assert hosts[0] is not None and hosts[1] is not None
    assert int(hosts[0].tensor[-1]) < int(hosts[1].tensor[0])
    ctrl.drain()
    loaded = [ctrl.load(host) for host in hosts]
    assert loaded[0] is not None and loaded[1] is not None
    ctrl.drain()
    for slots, expected in zip(loaded, rows, strict=True):
        assert torch.equal(device_rows(ctrl.device_pool)[slots.tensor], expected)
    assert calls["scatter_device_pages"] >= 1 and calls["scatter_pages"] == 0
