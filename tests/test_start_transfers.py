"""``start_transfers``: queued writes and loads issued together, the write between the load's
first layer group and the rest, each op as if issued alone (CPU, and the GPU backends on
real streams)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from controller_helpers import (
    CallOrder,
    check_layer_by_layer,
    device_rows,
    fill_unique,
    host_rows,
    make_controller,
    on_each_gpu_backend_and_layout,
    start_together,
    written_and_wiped,
)

from hicache.controller import (
    CacheController,
    Direction,
    TorchBackend,
    TransferBackend,
)
from hicache.controller.base import MovedTransfer
from hicache.controller.events import Event
from hicache.controller.load_groups import LINK_BYTES_PER_S
from hicache.pools import HostLayout, IndexSpace, Indices

D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE
NUM_LAYERS = 8


def queued_both(ctrl: CacheController, num_tokens: int
                ) -> tuple[Indices, torch.Tensor, Indices, Indices]:
    """A load of ``num_tokens`` stored rows and a write of as many other device rows,
    both queued: (the load's device slots, the rows it must bring, the written device
    slots, their host slots)."""
    host, rows = written_and_wiped(ctrl, num_tokens)
    fill_unique(ctrl.device_pool.data, offset=0.25)
    written = ctrl.device_allocator.try_alloc(num_tokens)
    assert written is not None
    backup = ctrl.write(written)
    target = ctrl.load(host)
    assert backup is not None and target is not None
    return target, rows, written, backup


def check_rows(ctrl: CacheController, target: Indices, rows: torch.Tensor, written: Indices,
               backup: Indices) -> None:
    assert torch.equal(device_rows(ctrl.device_pool)[target.tensor.cpu()], rows)
    assert torch.equal(host_rows(ctrl.host_pool)[backup.tensor.cpu()],
                       device_rows(ctrl.device_pool)[written.tensor.cpu()])


@pytest.mark.parametrize("cover_layers", [0, 1, 2, 5, NUM_LAYERS + 1])
def test_write_issued_after_the_load_groups_that_cover_its_issue(
        monkeypatch: pytest.MonkeyPatch, cover_layers: int) -> None:
    """The write goes after the first load groups whose bytes the link moves in the time the
    write's issue may take (here set to ``cover_layers`` layers' worth): after group 0 at
    least, after the whole load when its bytes do not cover it."""
    backend = CallOrder()
    ctrl = make_controller(backend, page_size=2, num_layers=NUM_LAYERS)
    target, rows, written, backup = queued_both(ctrl, 8)
    layer_bytes = 8 * ctrl.host_pool.geometry.token_bytes(1)
    at = start_together(ctrl, backend.calls, monkeypatch,
                        cover_layers * layer_bytes / LINK_BYTES_PER_S)
    directions = [direction for direction, _ in backend.calls]
    assert directions.count(D2H) == 1 and backend.calls[at][1] == tuple(range(NUM_LAYERS))
    before = [layer for _, layers in backend.calls[:at] for layer in layers]
    groups_before = [len(layers) for _, layers in backend.calls[:at]]
    assert at >= 1 and len(before) >= min(max(cover_layers, 1), NUM_LAYERS)
    assert len(before) - groups_before[-1] < max(cover_layers, 1)  # no group more than needed
    loaded = [layer for direction, layers in backend.calls if direction is H2D
              for layer in layers]
    assert loaded == list(range(NUM_LAYERS))
    acks = ctrl.poll()
    assert sorted(ack.direction.value for ack in acks) == sorted([D2H.value, H2D.value])
    check_rows(ctrl, target, rows, written, backup)
    assert ctrl.num_in_flight == 0


def test_one_direction_queued_is_the_plain_start() -> None:
    ctrl = make_controller(TorchBackend(), page_size=2, num_layers=NUM_LAYERS)
    assert ctrl.start_transfers() is None and ctrl.num_in_flight == 0
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    host = ctrl.write(device)
    assert host is not None
    consumer = ctrl.layer_events.consumer
    assert ctrl.start_transfers() is None  # a write alone: no event set taken
    assert ctrl.layer_events.consumer == consumer
    assert [ack.direction for ack in ctrl.poll()] == [D2H]
    assert ctrl.load(host) is not None
    set_id = ctrl.start_transfers()
    assert set_id is not None and ctrl.layer_events.consumer == set_id
    assert [ack.direction for ack in ctrl.poll()] == [H2D]


def test_refused_while_the_event_set_is_in_flight_issues_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ctrl = make_controller(TorchBackend(), page_size=2, num_layers=NUM_LAYERS)
    host = ctrl.host_pool.allocator.try_alloc(8)
    assert host is not None
    monkeypatch.setattr(Event, "query", lambda self: False)  # every op stays in flight
    for i in range(3):
        assert ctrl.load(Indices(host.tensor[2 * i: 2 * i + 2], IndexSpace.HOST_FULL))
        assert ctrl.start_loading() == i
    assert ctrl.load(Indices(host.tensor[6:8], IndexSpace.HOST_FULL)) is not None
    device = ctrl.device_allocator.try_alloc(2)
    assert device is not None and ctrl.write(device) is not None
    with pytest.raises(RuntimeError, match="event set 0 is still in flight"):
        ctrl.start_transfers()
    assert ctrl.stats.in_flight_ops == 3  # neither the write nor the load was issued
    assert ctrl.has_queued_writes and ctrl._ops.num_queued(H2D) == 1
    monkeypatch.undo()
    assert len(ctrl.poll()) == 3
    assert ctrl.start_transfers() == 0
    assert sorted(ack.direction.value for ack in ctrl.poll()) == [D2H.value, H2D.value]


class RefusesWrites(TorchBackend):
    """The torch backend, refusing every device-to-host copy (a write whose issue fails)."""

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        if direction is D2H:
            raise RuntimeError("write refused")
        super().copy(moved, local_layers, direction, keep_alive)


def test_a_failed_write_leaves_the_load_issued_and_tracked() -> None:
    ctrl = make_controller(RefusesWrites(), page_size=2, num_layers=NUM_LAYERS)
    host = ctrl.host_pool.allocator.try_alloc(8)
    assert host is not None
    target = ctrl.load(host)
    device = ctrl.device_allocator.try_alloc(8)
    assert target is not None and device is not None and ctrl.write(device) is not None
    with pytest.raises(RuntimeError, match="write refused"):
        ctrl.start_transfers()
    assert ctrl.layer_events.consumer == 0
    assert [ack.direction for ack in ctrl.poll()] == [H2D]  # the load was submitted


@on_each_gpu_backend_and_layout
def test_together_on_gpu_each_layer_waits_for_its_rows(backend: TransferBackend,
                                                       layout: HostLayout) -> None:
    """Issued together on real streams (the load stream held back at first), a forward that
    waits per layer reads the loaded rows, and the write's host rows are the device's."""
    ctrl = make_controller(backend, device="cuda", page_size=4, device_pages=64,
                           host_pages=160, num_layers=NUM_LAYERS, layout=layout,
                           dtype=torch.bfloat16)
    target, rows, written, backup = queued_both(ctrl, 64)
    with torch.cuda.stream(ctrl.load_stream):
        torch.cuda._sleep(20_000_000)  # the load starts late
    assert ctrl.start_transfers() is not None
    check_layer_by_layer(ctrl, target, rows, torch.cuda.Stream())
    ctrl.drain()
    check_rows(ctrl, target, rows, written, backup)
    assert ctrl.num_in_flight == 0
