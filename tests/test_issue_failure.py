"""An op whose issue raises half way (a staging buffer's allocation failed, a Ctrl-C between
two copies) is queued again, not lost: its calls keep their pages held, nothing is counted
as in flight, a load's event set is free again and the consumer set is the one before, and
the next ``start_*`` issues it and acknowledges it with its callers' tags and rows.

Before, the merged op was dropped on the floor: its pages stayed held for good, the tree's
nodes waited for an ack that never came, and on a GPU the op's index tensors were never
recorded on the stream that the copies issued before the error still read.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from controller_helpers import (
    device_rows,
    fill_unique,
    host_rows,
    make_controller,
    make_hybrid,
    written_and_wiped,
)
from test_service import make_config, put, rows_ok

from hicache.controller import CacheController, Direction, TorchBackend, TransferBackend, op_issue
from hicache.controller.base import MovedTransfer, PoolTransfer
from hicache.factory import build_service
from hicache.pools import HostLayout, Indices

D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE
NUM_LAYERS = 8


class Boom(RuntimeError):
    """A copy's failure (as a staging buffer's allocation that ran out of memory)."""


class FailsAt(TorchBackend):
    """The torch backend, raising ``error`` instead of the ``at``-th copy call (from 0) of
    ``direction``, ``times`` times in a row (each retry counts its calls from 0 again)."""

    def __init__(self, direction: Direction, at: int = 0, times: int = 1,
                 error: type[BaseException] = Boom) -> None:
        super().__init__()
        self.direction, self.at, self.times, self.error = direction, at, times, error
        self.calls = 0

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        if direction is self.direction and self.times:
            if self.calls == self.at:
                self.times -= 1
                self.calls = 0
                raise self.error("copy failed")
            self.calls += 1
        super().copy(moved, local_layers, direction, keep_alive)


class SelectFails(TorchBackend):
    """The torch backend, whose choice of an executor for an op raises once (the merge of
    the queued calls fails before any copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def select(self, direction: Direction, layout: HostLayout, num_tokens: int,
               layer_wise: bool, pairs: PoolTransfer | None = None) -> TransferBackend:
        if self.armed:
            self.armed = False
            raise Boom("select failed")
        return self


def queued_write(ctrl: CacheController, num_tokens: int, tag: object = "w"
                 ) -> tuple[Indices, Indices]:
    device = ctrl.device_allocator.try_alloc(num_tokens)
    assert device is not None
    host = ctrl.write(device, tag)
    assert host is not None
    return device, host


def check_still_queued(ctrl: CacheController, direction: Direction, device: Indices) -> None:
    """The calls are queued, nothing is issued, and their device slots are still held."""
    assert ctrl._ops.num_queued(direction) == 1 and not ctrl._ops.in_flight(direction)
    assert ctrl.is_in_flight(device)
    with pytest.raises(ValueError, match=r"in flight|being"):
        ctrl.evict_device(device)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_a_write_whose_issue_raised_is_issued_by_the_next_call(
        error: type[BaseException]) -> None:
    backend = FailsAt(D2H, error=error)
    ctrl = make_controller(backend, page_size=2, num_layers=NUM_LAYERS)
    device, host = queued_write(ctrl, 8, tag="mine")
    with pytest.raises(error):
        ctrl.start_writing()
    check_still_queued(ctrl, D2H, device)
    assert ctrl.stats.in_flight_ops == 0
    ctrl.start_writing()
    acks = ctrl.poll()
    assert [(ack.direction, ack.tags) for ack in acks] == [(D2H, ["mine"])]
    assert torch.equal(host_rows(ctrl.host_pool)[host.tensor],
                       device_rows(ctrl.device_pool)[device.tensor])
    assert ctrl.num_in_flight == 0 and not ctrl.is_in_flight(device)
    ctrl.evict_device(device)


def test_writes_queued_after_the_failure_go_with_the_retry_in_order() -> None:
    ctrl = make_controller(FailsAt(D2H), page_size=2, num_layers=NUM_LAYERS)
    first, first_host = queued_write(ctrl, 4, tag="first")
    with pytest.raises(Boom):
        ctrl.start_writing()
    second, second_host = queued_write(ctrl, 4, tag="second")
    ctrl.start_writing()
    assert [ack.tags for ack in ctrl.poll()] == [["first", "second"]]
    for device, host in ((first, first_host), (second, second_host)):
        assert torch.equal(host_rows(ctrl.host_pool)[host.tensor],
                           device_rows(ctrl.device_pool)[device.tensor])


def test_a_merge_that_raised_leaves_the_calls_queued() -> None:
    ctrl = make_controller(SelectFails(), page_size=2, num_layers=NUM_LAYERS)
    device, host = queued_write(ctrl, 4)
    with pytest.raises(Boom, match="select failed"):
        ctrl.start_writing()
    check_still_queued(ctrl, D2H, device)
    ctrl.start_writing()
    assert [ack.direction for ack in ctrl.poll()] == [D2H]
    assert torch.equal(host_rows(ctrl.host_pool)[host.tensor],
                       device_rows(ctrl.device_pool)[device.tensor])


@pytest.mark.parametrize("at", [0, 1])  # the torch backend on a CPU: layer 0, then the rest
@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_a_load_whose_issue_raised_keeps_its_set_free_and_the_consumer(
        at: int, error: type[BaseException]) -> None:
    """The load's issue raises at its ``at``-th layer group, more times in a row than the
    ring has sets: each failure gives its set back (no "still in flight" refusal), the
    consumer stays the one before, and the retry brings every layer's rows."""
    backend = FailsAt(H2D, at=at, times=0, error=error)
    ctrl = make_controller(backend, page_size=2, num_layers=NUM_LAYERS)
    host, rows = written_and_wiped(ctrl, 8)  # drained: the write's ack is taken
    target = ctrl.load(host, "load")
    assert target is not None
    backend.times = ctrl.layer_events.num_sets + 1
    consumer = ctrl.layer_events.consumer
    for _ in range(backend.times):
        with pytest.raises(error):
            ctrl.start_loading()
        assert ctrl.layer_events.consumer == consumer
        check_still_queued(ctrl, H2D, target)
    set_id = ctrl.start_loading()
    assert set_id is not None and ctrl.layer_events.consumer == set_id
    for layer in range(NUM_LAYERS):
        ctrl.wait_until(layer)
    assert [(ack.direction, ack.tags) for ack in ctrl.poll()] == [(H2D, ["load"])]
    assert torch.equal(device_rows(ctrl.device_pool)[target.tensor], rows)
    assert ctrl.num_in_flight == 0


def both_queued(ctrl: CacheController) -> tuple[Indices, torch.Tensor, Indices, Indices]:
    host, rows = written_and_wiped(ctrl, 8)
    fill_unique(ctrl.device_pool.data, offset=0.25)
    written, backup = queued_write(ctrl, 8)
    target = ctrl.load(host)
    assert target is not None
    return target, rows, written, backup


def check_both(ctrl: CacheController, target: Indices, rows: torch.Tensor, written: Indices,
               backup: Indices) -> None:
    assert torch.equal(device_rows(ctrl.device_pool)[target.tensor], rows)
    assert torch.equal(host_rows(ctrl.host_pool)[backup.tensor],
                       device_rows(ctrl.device_pool)[written.tensor])
    assert ctrl.num_in_flight == 0


def test_together_a_load_that_raised_before_the_write_requeues_both() -> None:
    backend = FailsAt(H2D, times=0)
    ctrl = make_controller(backend, page_size=2, num_layers=NUM_LAYERS)
    target, rows, written, backup = both_queued(ctrl)
    backend.times = 1
    consumer = ctrl.layer_events.consumer
    with pytest.raises(Boom):
        ctrl.start_transfers()
    assert ctrl.layer_events.consumer == consumer
    check_still_queued(ctrl, H2D, target)
    assert ctrl.has_queued_writes and ctrl.is_in_flight(written)
    assert ctrl.start_transfers() is not None
    assert sorted(ack.direction.value for ack in ctrl.poll()) == sorted([D2H.value, H2D.value])
    check_both(ctrl, target, rows, written, backup)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_together_a_write_that_raised_is_requeued_and_the_load_issued(
        error: type[BaseException]) -> None:
    backend = FailsAt(D2H, times=0, error=error)
    ctrl = make_controller(backend, page_size=2, num_layers=NUM_LAYERS)
    target, rows, written, backup = both_queued(ctrl)
    backend.times = 1
    with pytest.raises(error):
        ctrl.start_transfers()
    assert ctrl.layer_events.consumer is not None
    assert [ack.direction for ack in ctrl.poll()] == [H2D]
    check_still_queued(ctrl, D2H, written)
    assert ctrl.start_transfers() is None  # the write alone
    assert [ack.direction for ack in ctrl.poll()] == [D2H]
    check_both(ctrl, target, rows, written, backup)


def test_together_a_load_that_raised_after_the_write_requeues_the_load_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The load's last layer group raises after the write went between its groups (the
    write's issue taken as instant: it goes after layer 0): the write is issued and
    acknowledged, the load queued again."""
    monkeypatch.setattr(op_issue, "WRITE_ISSUE_S", 0.0)
    monkeypatch.setattr(op_issue, "WRITE_ISSUE_S_PER_BYTE", 0.0)
    backend = FailsAt(H2D, at=0, times=0)
    ctrl = make_controller(backend, page_size=2, num_layers=NUM_LAYERS)
    target, rows, written, backup = both_queued(ctrl)
    calls: list[Direction] = []
    copy = backend.copy

    def note(moved: MovedTransfer, local: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        calls.append(direction)
        if direction is H2D and D2H in calls:
            raise Boom("late load group")
        copy(moved, local, direction, keep_alive)

    backend.copy = note  # type: ignore[method-assign]
    consumer = ctrl.layer_events.consumer
    with pytest.raises(Boom, match="late load group"):
        ctrl.start_transfers()
    assert D2H in calls and calls[0] is H2D
    assert ctrl.layer_events.consumer == consumer
    check_still_queued(ctrl, H2D, target)
    del backend.copy
    assert [ack.direction for ack in ctrl.poll()] == [D2H]
    assert ctrl.start_transfers() is not None
    assert [ack.direction for ack in ctrl.poll()] == [H2D]
    check_both(ctrl, target, rows, written, backup)


@pytest.mark.parametrize("at", [0, 1])
def test_a_hybrid_write_that_raised_between_its_pools_is_issued_again(at: int) -> None:
    """A hybrid write copies its full and then its SWA pool: raising at either leaves the
    whole write queued, and the retry writes both."""
    ctrl = make_hybrid(FailsAt(D2H, at=at))
    pool = ctrl.hybrid_pool
    full = pool.try_alloc(8)
    assert full is not None
    host = ctrl.write(full, "hybrid")
    assert host is not None
    with pytest.raises(Boom):
        ctrl.start_writing()
    assert ctrl.has_queued_writes and ctrl.stats.in_flight_ops == 0
    ctrl.start_writing()
    assert [ack.tags for ack in ctrl.poll()] == [["hybrid"]]
    assert torch.equal(host_rows(ctrl.host_pool)[host.full.tensor],
                       device_rows(pool.full)[full.tensor])
    swa = pool.swa_slots_of(full).tensor
    kept = host.swa.tensor != 0
    assert kept.any()
    assert torch.equal(host_rows(ctrl.host_swa)[host.swa.tensor[kept]],
                       device_rows(pool.swa)[swa[kept]])


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_a_service_step_whose_write_raised_backs_the_prefix_up_at_the_next_step(
        error: type[BaseException]) -> None:
    """Through the service: the step's write raises once; the tree is intact, the node
    waits for its backup, the next step issues it, and the prefix comes back from the
    host after the device copy is evicted."""
    service = build_service(make_config("write_through"))
    try:
        service.controller.backend = FailsAt(D2H, error=error)
        tokens = [1, 2, 3, 4, 5, 6]
        assert put(service, tokens)  # write-through: the backup is queued for the step
        with pytest.raises(error):
            service.step()
        service.check_integrity()
        node = next(n for n in service.tree.nodes() if n.tokens == tuple(tokens))
        assert node.on_device and not node.is_backed_up and node.is_in_flight
        service.step()
        service.controller.drain()
        service.step()
        service.check_integrity()
        assert node.is_backed_up and not node.is_in_flight
        service.evict(10**6)
        assert not node.on_device
        match = service.match(tokens)
        assert match.host_hit_tokens == len(tokens)
        loaded = service.load_back(match, 16)
        assert loaded.queued
        service.start_loading()
        for layer in range(service.controller.num_layers):
            service.wait_until(layer)
        assert rows_ok(service, tokens, loaded.device_indices)
        service.controller.drain()
        service.step()
        service.check_integrity()
    finally:
        service.stop()
