"""The single-call paths of a controller op on a CPU pool (one queued write, its merge, its
stats) give what the general paths give: rows, pair order, host runs, acks."""

from __future__ import annotations

import torch
from controller_helpers import device_rows, host_rows, make_controller

from hicache.controller import TorchBackend
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
        device = ctrl.device_allocator.try_alloc(6)
        assert device is not None
        host = ctrl.write(device)
        assert host is not None
        ctrl.start_writing()
        assert len(ctrl.poll()) == 1
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


def test_caller_tensors_are_not_the_ops() -> None:
    """The op of one write reads its own copies: the caller's device slots and the host
    slots it got back, both refilled before the op is issued, change nothing."""
    ctrl = make_controller(TorchBackend(), page_size=2)
    before = device_rows(ctrl.device_pool)
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    passed = Indices(device.tensor.clone(), IndexSpace.DEVICE_FULL)
    host = ctrl.write(passed)
    assert host is not None
    expected = host.tensor.clone()
    passed.tensor.fill_(2)
    host.tensor.fill_(2)
    ctrl.start_writing()
    assert len(ctrl.poll()) == 1
    assert torch.equal(host_rows(ctrl.host_pool)[expected], before[device.tensor])
