"""``num_in_flight`` counts every op not yet acknowledged: calls queued in each direction
and ops issued in each direction, all four at once (CPU)."""

from __future__ import annotations

from controller_helpers import make_controller
from test_controller_op_paths import written_host

from hicache.controller import CacheController, TorchBackend
from hicache.pools import Indices


def queue_write(ctrl: CacheController) -> None:
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    assert ctrl.write(device) is not None


def queue_load(ctrl: CacheController, host: Indices) -> None:
    assert ctrl.load(host) is not None


def test_num_in_flight_counts_queued_and_issued_ops_of_both_directions() -> None:
    ctrl = make_controller(TorchBackend(), page_size=2)
    first, _ = written_host(ctrl, 4)
    second, _ = written_host(ctrl, 4)
    assert ctrl.num_in_flight == 0
    queue_write(ctrl)
    queue_write(ctrl)
    assert ctrl.num_in_flight == 2  # two calls queued
    ctrl.start_writing()
    assert ctrl.num_in_flight == 1  # issued as one op
    queue_load(ctrl, first)
    ctrl.start_loading()
    assert ctrl.num_in_flight == 2  # a write and a load issued
    queue_write(ctrl)
    queue_load(ctrl, second)
    assert ctrl.num_in_flight == 4  # and one of each queued
    assert len(ctrl.poll()) == 2  # the issued ones
    assert ctrl.num_in_flight == 2
    ctrl.start_writing()
    ctrl.start_loading()
    assert len(ctrl.poll()) == 2
    assert ctrl.num_in_flight == 0
