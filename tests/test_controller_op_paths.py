"""The single-call paths of a controller op on a CPU pool (one queued write, its merge, its
stats) give what the general paths give: rows, pair order, host runs, acks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from controller_helpers import SENTINEL, device_rows, host_rows, make_controller, untouched

from hicache.controller import CacheController, Direction, MovedTransfer, TorchBackend
from hicache.controller.index_moves import owned_pages_copy
from hicache.pools import IndexSpace, Indices


class ReversingBackend(TorchBackend):
    """A torch backend that reorders every op's index pairs (last first) and counts it."""

    def __init__(self) -> None:
        self.orders = 0

    def order_pairs(self, host_index: torch.Tensor, device_index: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.orders += 1
        return host_index.flip(0), device_index.flip(0)


def test_a_backend_that_orders_pairs_is_asked_for_each_op() -> None:
    """A backend overriding order_pairs gets every op's pairs (CPU pools too), and the rows
    still land in the slots the write returned."""
    backend = ReversingBackend()
    ctrl = make_controller(backend, page_size=2)
    before = device_rows(ctrl.device_pool)
    for _ in range(2):
        device, host = written(ctrl, 6)
        assert torch.equal(host_rows(ctrl.host_pool)[host.tensor], before[device.tensor])
    assert backend.orders == 2


def test_one_run_of_host_pages_counts_one_run() -> None:
    """A write whose host slots are one allocation's single run counts one run of its
    tokens; two writes merged into one op count the runs of both."""
    ctrl = make_controller(TorchBackend(), page_size=2)
    device = ctrl.device_allocator.try_alloc(8)
    assert device is not None and ctrl.write(device) is not None
    ctrl.start_writing()
    ctrl.poll()
    key = ("device_to_host", "full")
    assert (ctrl.stats.host_runs[key], ctrl.stats.host_run_tokens[key]) == (1, 8)
    first, second = ctrl.device_allocator.try_alloc(4), ctrl.device_allocator.try_alloc(4)
    assert first is not None and second is not None
    assert ctrl.write(first) is not None and ctrl.write(second) is not None
    ctrl.start_writing()
    ctrl.poll()  # one op of 8 slots in one run: the second call's follow the first's
    assert (ctrl.stats.host_runs[key], ctrl.stats.host_run_tokens[key]) == (2, 16)


@pytest.mark.parametrize("direction", ["write", "load"])
def test_caller_tensors_are_not_the_ops(direction: str) -> None:
    """The op of one write or load reads its own copies (of an allocation's runs: made from
    their bounds): the slots the caller passed and the slots it got back, both refilled
    before the op is issued, change nothing; the rows land in the returned slots."""
    ctrl = make_controller(TorchBackend(), page_size=2)
    before = device_rows(ctrl.device_pool)
    if direction == "write":
        device = ctrl.device_allocator.try_alloc(4)
        assert device is not None
        passed = Indices(device.tensor.clone(), IndexSpace.DEVICE_FULL)
        returned = ctrl.write(passed)
    else:
        device, host = written(ctrl, 6)
        passed = Indices(host.tensor.clone(), IndexSpace.HOST_FULL)
        returned = ctrl.load(passed)
    assert returned is not None
    expected = returned.tensor.clone()
    passed.tensor.fill_(2)
    returned.tensor.fill_(2)
    ctrl.start_writing()
    ctrl.start_loading()
    assert len(ctrl.poll()) == 1
    rows = host_rows(ctrl.host_pool) if direction == "write" else device_rows(ctrl.device_pool)
    assert torch.equal(rows[expected], before[device.tensor])


def test_write_without_copies_reads_the_callers_tensors() -> None:
    """write_without_copies queues the op on the caller's device tensor and the host tensor
    it hands back (no copies), and the rows land in those host slots."""
    ctrl = make_controller(TorchBackend(), page_size=2)
    before = device_rows(ctrl.device_pool)
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    ctrl.add_observer(lambda _d, transfers, _t: seen.append(
        (transfers[0].host_indices.tensor, transfers[0].device_indices.tensor)))
    host = ctrl.write_without_copies(device, np.array([1, 2], dtype=np.int64))
    assert host is not None
    assert seen[0][0] is host.tensor and seen[0][1] is device.tensor
    ctrl.start_writing()
    assert len(ctrl.poll()) == 1
    assert torch.equal(host_rows(ctrl.host_pool)[host.tensor], before[device.tensor])


def test_write_without_copies_keeps_the_checks_of_write() -> None:
    """write_without_copies refuses a page in flight and an unallocated page, as write does,
    with nothing allocated or queued."""
    ctrl = make_controller(TorchBackend(), page_size=2)
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    pages = np.array([1, 2], dtype=np.int64)
    assert ctrl.write_without_copies(device, pages) is not None
    free_host = ctrl.host_pool.allocator.num_free_tokens
    with pytest.raises(ValueError, match=r"write_without_copies: .*already being backed up"):
        ctrl.write_without_copies(device, pages)
    ctrl.start_writing()
    assert len(ctrl.poll()) == 1
    ctrl.evict_device(device)
    with pytest.raises(ValueError, match=r"write_without_copies: .*not allocated"):
        ctrl.write_without_copies(device, pages)
    assert ctrl.host_pool.allocator.num_free_tokens == free_host
    assert ctrl.num_in_flight == 0


class RecordingBackend(TorchBackend):
    """A torch backend that keeps every moved transfer it copies."""

    def __init__(self) -> None:
        self.moved: list[MovedTransfer] = []

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        self.moved.append(moved)
        super().copy(moved, local_layers, direction, keep_alive)


def test_slot_runs_from_the_pages_move_the_right_rows() -> None:
    """An op on CPU pools finds its slot runs from its pages: a slice for a run (a write's
    fresh host slots, a load's fresh device slots), None for slots out of order; the rows
    land in the named slots and every other row keeps its value."""
    backend = RecordingBackend()
    ctrl = make_controller(backend, page_size=128, device_pages=8, host_pages=8)
    before = device_rows(ctrl.device_pool)
    first, second = ctrl.device_allocator.try_alloc(256), ctrl.device_allocator.try_alloc(128)
    assert first is not None and second is not None  # pages 1-2, then 3
    device = Indices(torch.cat([second.tensor, first.tensor]), IndexSpace.DEVICE_FULL)
    host = ctrl.write(device)
    assert host is not None
    ctrl.start_writing()
    assert len(ctrl.poll()) == 1
    assert backend.moved[-1].pages is not None
    assert backend.moved[-1].pages.runs() == (slice(128, 512), None)
    assert backend.moved[-1].row_selectors is not None
    assert backend.moved[-1].row_selectors[0] == slice(128, 512)
    rows = host_rows(ctrl.host_pool)
    assert torch.equal(rows[host.tensor], before[device.tensor])
    assert bool((untouched(rows, host.tensor) == SENTINEL).all())
    back = Indices(torch.cat([host.tensor[256:], host.tensor[:256]]), IndexSpace.HOST_FULL)
    loaded = ctrl.load(back)
    assert loaded is not None
    ctrl.start_loading()
    assert len(ctrl.poll()) == 1
    assert backend.moved[-1].pages is not None
    assert backend.moved[-1].pages.runs() == (None, slice(512, 896))
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[loaded.tensor], rows[back.tensor])
    assert torch.equal(untouched(after, loaded.tensor), untouched(before, loaded.tensor))


def written(ctrl: CacheController, num_tokens: int) -> tuple[Indices, Indices]:
    """Fresh device slots of ``num_tokens`` and the host slots of their write, acknowledged."""
    device = ctrl.device_allocator.try_alloc(num_tokens)
    assert device is not None
    host = ctrl.write(device)
    assert host is not None
    ctrl.start_writing()
    assert len(ctrl.poll()) == 1
    return device, host


def written_host(ctrl: CacheController, num_tokens: int) -> tuple[Indices, torch.Tensor]:
    """Host slots of ``num_tokens`` written back (acknowledged, the device copy freed) and
    the rows they hold."""
    device, host = written(ctrl, num_tokens)
    ctrl.evict_device(device)
    return host, host_rows(ctrl.host_pool)[host.tensor].clone()


def test_a_load_tells_the_op_whether_its_host_pages_ascend() -> None:
    """load() marks its op's host pages ascending when they are (the pairs then need no
    ordering: one host run is a slice) and not when they are out of order; the rows land
    in the device slots it returned either way, and no other row changes."""
    backend = RecordingBackend()
    ctrl = make_controller(backend, page_size=128, device_pages=8, host_pages=8)
    _, host = written(ctrl, 256)
    flipped = host.tensor.view(-1, 128).flip(0).reshape(-1)
    for order, ascending in ((host.tensor, True), (flipped, False)):
        before = device_rows(ctrl.device_pool).clone()
        loaded = ctrl.load(Indices(order.clone(), IndexSpace.HOST_FULL))
        assert loaded is not None
        ctrl.start_loading()
        assert len(ctrl.poll()) == 1
        pages = backend.moved[-1].pages
        assert pages is not None and pages.host_ascending is ascending
        after = device_rows(ctrl.device_pool)
        assert torch.equal(after[loaded.tensor], host_rows(ctrl.host_pool)[order])
        assert torch.equal(untouched(after, loaded.tensor), untouched(before, loaded.tensor))
        ctrl.evict_device(loaded)


def test_load_without_copies_reads_the_callers_tensors() -> None:
    """load_without_copies queues the op on the caller's host tensor and the device tensor
    it hands back (no copies), and the rows land in those device slots."""
    ctrl = make_controller(TorchBackend(), page_size=2)
    host, rows = written_host(ctrl, 4)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    ctrl.add_observer(lambda _d, transfers, _t: seen.append(
        (transfers[0].host_indices.tensor, transfers[0].device_indices.tensor)))
    pages = host.tensor.numpy()[::2] // 2
    loaded = ctrl.load_without_copies(host, pages)
    assert loaded is not None
    assert seen[0][0] is host.tensor and seen[0][1] is loaded.tensor
    ctrl.start_loading()
    assert len(ctrl.poll()) == 1
    assert torch.equal(device_rows(ctrl.device_pool)[loaded.tensor], rows)


def test_load_without_copies_keeps_the_checks_of_load() -> None:
    """load_without_copies refuses host pages a write still fills and unallocated host
    pages, as load does, with no device slot allocated and nothing queued; it returns None
    when the device pool is full."""
    ctrl = make_controller(TorchBackend(), page_size=2)
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    filling = ctrl.write(device)
    assert filling is not None
    free_device = ctrl.device_allocator.num_free_tokens
    pages = filling.tensor.numpy()[::2] // 2
    with pytest.raises(ValueError, match=r"load_without_copies: HOST_FULL slot \d+ .*"):
        ctrl.load_without_copies(filling, pages)
    assert ctrl.device_allocator.num_free_tokens == free_device
    assert ctrl.num_in_flight == 1  # the write alone
    ctrl.start_writing()
    assert len(ctrl.poll()) == 1
    ctrl.evict_host(filling)
    with pytest.raises(ValueError, match=r"load_without_copies: .*not allocated"):
        ctrl.load_without_copies(filling, pages)
    assert ctrl.device_allocator.num_free_tokens == free_device
    assert ctrl.num_in_flight == 0
    host, _ = written_host(ctrl, 4)
    rest = ctrl.device_allocator.try_alloc(ctrl.device_allocator.num_free_tokens)
    assert rest is not None
    assert ctrl.load_without_copies(host, host.tensor.numpy()[::2] // 2) is None
    assert ctrl.num_in_flight == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_owned_copies_of_page_runs_equal_the_slots(page_size: int) -> None:
    """An op's own copy of whole pages: from the run's bounds where the pages are one
    ascending run, else a clone; either way the caller's values as int64, in a tensor of
    its own, for 200 random page sets (runs, gaps, descending, shuffled, int32)."""
    rng = np.random.default_rng(page_size)
    for _ in range(200):
        count = int(rng.integers(1, 12))
        first = int(rng.integers(1, 50))
        pages = np.arange(first, first + count, dtype=np.int64)
        shape = rng.integers(4)
        if shape == 1 and count > 1:
            pages[rng.integers(1, count):] += int(rng.integers(1, 5))  # a gap
        elif shape == 2:
            pages = pages[::-1].copy()
        elif shape == 3:
            pages = rng.permutation(pages)
        slots = torch.from_numpy((pages[:, None] * page_size
                                  + np.arange(page_size)).reshape(-1))
        if rng.integers(2):
            slots = slots.to(torch.int32)
        given = Indices(slots, IndexSpace.HOST_FULL)
        for ascending in (None, bool(count < 2 or (np.diff(pages) > 0).all())):
            copy = owned_pages_copy(given, pages, page_size, ascending)
            assert copy.space is IndexSpace.HOST_FULL and copy.tensor.dtype is torch.int64
            assert torch.equal(copy.tensor, slots.to(torch.int64))
            assert copy.tensor.data_ptr() != slots.data_ptr()
