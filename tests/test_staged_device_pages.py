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

from hicache.controller import CacheController, chunk_slots, direct_staging, index_moves
from hicache.controller.backends import TorchBackend
from hicache.controller.base import Direction, MovedTransfer, PoolTransfer, SlotPages
from hicache.controller.index_moves import move_checked, move_whole_pages
from hicache.controller.slot_segments import device_pages
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


def written_back(ctrl: CacheController, num_pages: int
                 ) -> tuple[Indices, torch.Tensor, Indices]:
    """``num_pages`` freshly allocated device pages written to the host and drained: their
    device slots, their rows as written, and the host slots holding them."""
    written = ctrl.device_allocator.try_alloc(num_pages * PAGE)
    assert written is not None
    rows = device_rows(ctrl.device_pool)[written.tensor].clone()
    host = ctrl.write(written)
    assert host is not None
    ctrl.drain()
    return written, rows, host


def test_whole_pages_move_by_page(calls: dict[str, int]) -> None:
    """A write of 12 allocated device pages and its load back (3 chunks of 4 pages each)
    gather and scatter page by page, and bring back exactly the written rows; every other
    device row is untouched."""
    ctrl = direct_controller()
    _, rows, host = written_back(ctrl, 12)
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


def test_an_op_of_whole_pages_brings_its_device_pages(calls: dict[str, int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A write and load of whole pages through the controller carry the pages their checks
    and allocations found: the device pages are uploaded with the device index and the host
    segments come from the host pages, so neither is looked for in the slots again (both
    finders fail here if called); into a fragmented allocation (device pages not one run)
    the rows still land at exactly the allocated slots, page by page."""
    ctrl = direct_controller(num_layers=2)
    first, rows, host = written_back(ctrl, 6)
    rest = ctrl.device_allocator.try_alloc(ctrl.device_allocator.num_free_tokens)
    assert rest is not None  # the pool full: what is freed next is all there is
    pages = first.tensor.view(-1, PAGE)  # free every other page: the next allocation is split
    ctrl.device_allocator.free(Indices(pages[::2].reshape(-1).clone(), IndexSpace.DEVICE_FULL))

    def refused(*args: object) -> None:
        raise AssertionError("the op's pages were looked for in its slots")

    monkeypatch.setattr(chunk_slots, "device_pages", refused)
    monkeypatch.setattr(chunk_slots, "whole_pages", refused)
    moved: list[MovedTransfer | None] = []
    found = index_moves.move_whole_pages

    def spy(*args: Any) -> MovedTransfer | None:
        moved.append(found(*args))
        return moved[-1]

    monkeypatch.setattr(index_moves, "move_whole_pages", spy)
    part = Indices(host.tensor[:3 * PAGE].clone(), IndexSpace.HOST_FULL)
    before = device_rows(ctrl.device_pool).clone()
    loaded = ctrl.load(part)
    assert loaded is not None
    ctrl.drain()
    loaded_pages = loaded.tensor.view(-1, PAGE)[:, 0] // PAGE
    assert not bool((loaded_pages[1:] == loaded_pages[:-1] + 1).all())  # not one run
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[loaded.tensor], rows[:3 * PAGE])
    assert torch.equal(untouched(after, loaded.tensor), untouched(before, loaded.tensor))
    assert len(moved) == 1 and moved[0] is not None
    index = moved[0].device_page_index
    assert index is not None and index.tolist() == loaded_pages.tolist()
    assert calls["scatter_device_pages"] >= 1 and calls["scatter_pages"] == 0


def test_pages_go_only_to_a_backend_that_reads_them() -> None:
    """``move_whole_pages`` hands the pages over only where the backend reads device
    pages of whole pages as they are (staged, to or from a ``page_first_direct`` or
    ``layer_first`` host): not for another backend or a ``page_first`` host, not when the
    device pages are of another size, and not when the pairs would be reordered."""
    ctrl = direct_controller(num_layers=2)
    device = Indices(torch.arange(44, 52), IndexSpace.DEVICE_FULL)

    def transfer(host_slots: torch.Tensor, pool_ctrl: CacheController = ctrl) -> PoolTransfer:
        return PoolTransfer(name="full", host_pool=pool_ctrl.host_pool,
                            device_pool=pool_ctrl.device_pool,
                            host_indices=Indices(host_slots, IndexSpace.HOST_FULL),
                            device_indices=device, layers=(0, 1))

    def pages(host_pages: list[int], ascending: bool, page_size: int = PAGE) -> SlotPages:
        return SlotPages(np.array(host_pages), PAGE, np.array([11, 12]), page_size, ascending)

    in_order = transfer(torch.arange(8, 16))
    found = move_whole_pages(in_order, ctrl.backend, pages([2, 3], True))
    assert found is not None and found.host_index is in_order.host_indices.tensor
    assert found.device_page_index is not None and found.device_page_index.tolist() == [11, 12]
    swapped = transfer(torch.cat([torch.arange(12, 16), torch.arange(8, 12)]))
    assert move_whole_pages(swapped, ctrl.backend, pages([3, 2], False)) is None
    assert move_whole_pages(in_order, ctrl.backend, pages([2, 3], True, 2 * PAGE)) is None
    layer_first = make_controller(StagedBackend(4 * PAGE), page_size=PAGE, num_layers=2,
                                  device_pages=40, host_pages=40)
    found = move_whole_pages(transfer(torch.arange(8, 16), layer_first), layer_first.backend,
                             pages([2, 3], True))
    assert found is not None and found.device_page_index is not None
    assert found.device_page_index.tolist() == [11, 12]
    page_first = make_controller(StagedBackend(4 * PAGE), page_size=PAGE, num_layers=2,
                                 device_pages=40, host_pages=40, layout=HostLayout.PAGE_FIRST)
    assert move_whole_pages(transfer(torch.arange(8, 16), page_first), page_first.backend,
                            pages([2, 3], True)) is None
    assert move_whole_pages(in_order, TorchBackend(), pages([2, 3], True)) is None
