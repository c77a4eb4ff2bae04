"""A staged load of whole ``page_first_direct`` host pages into whole device pages scatters
page by page (one index entry a page); any other device slots take the slot-by-slot store.
Both leave exactly the loaded rows changed (CPU pools: plain copies stand in for the copy
engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from controller_helpers import device_rows, make_controller, untouched

from hicache.controller import CacheController, direct_staging
from hicache.controller.base import Direction, MovedTransfer, PoolTransfer
from hicache.controller.direct_staging import device_pages
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
def scatters(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the two whole-page scatters (by device page, by device slot)."""
    counts = {"pages": 0, "slots": 0}
    by_page = direct_staging.DirectStaging.scatter_device_pages
    by_slot = direct_staging.DirectStaging.scatter_pages

    def page_scatter(*args: object) -> None:
        counts["pages"] += 1
        by_page(*args)  # type: ignore[arg-type]

    def slot_scatter(*args: object) -> None:
        counts["slots"] += 1
        by_slot(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_staging.DirectStaging, "scatter_device_pages", page_scatter)
    monkeypatch.setattr(direct_staging.DirectStaging, "scatter_pages", slot_scatter)
    return counts


def direct_controller(num_layers: int = 3) -> CacheController:
    """A ``page_first_direct`` controller whose staging holds 4 pages of every layer."""
    return make_controller(StagedBackend(4 * PAGE), page_size=PAGE, num_layers=num_layers,
                           layout=HostLayout.PAGE_FIRST_DIRECT, device_pages=40, host_pages=40)


def test_a_load_of_whole_pages_scatters_by_page(scatters: dict[str, int]) -> None:
    """A load back of 12 written pages (3 chunks of 4 pages) scatters page by page
    and brings back exactly the written rows; every other device row is untouched."""
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
    assert scatters == {"pages": 3, "slots": 0}  # one group of all layers, 3 chunks


@pytest.mark.parametrize("device_slots", [
    list(range(42, 50)),  # two pages' worth, each straddling two device pages
    [47, 46, 45, 44, 51, 50, 49, 48],  # two whole pages, slots reversed in each
], ids=["straddling", "reversed"])
def test_a_load_into_other_slots_scatters_by_slot(scatters: dict[str, int],
                                                  device_slots: list[int]) -> None:
    """Whole host pages loaded into device slots that are not whole pages in order land
    slot by slot at exactly those slots; the rest of the device pool is untouched."""
    ctrl = direct_controller(num_layers=2)
    written = ctrl.device_allocator.try_alloc(2 * PAGE)
    assert written is not None
    host = ctrl.write(written)
    assert host is not None
    ctrl.drain()
    target = Indices(torch.tensor(device_slots), IndexSpace.DEVICE_FULL)
    transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                            host_indices=host, device_indices=target, layers=(0, 1))
    moved = MovedTransfer(transfer, *ctrl.move_indices(host, target))
    before = device_rows(ctrl.device_pool).clone()
    ctrl.backend.copy(moved, [0, 1], Direction.HOST_TO_DEVICE, [])
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[target.tensor], before[written.tensor])
    assert torch.equal(untouched(after, target.tensor), untouched(before, target.tensor))
    assert scatters == {"pages": 0, "slots": 1}
