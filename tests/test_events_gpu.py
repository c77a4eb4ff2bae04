"""Completion events on a real GPU where a wrong answer is a race, not an error: a layer
wait waits for the layer asked (not for an earlier one that already arrived), a ring set
whose load still runs is not handed out again, a write waits for every registered producer
stream, for the stream it was queued on and for the stream it was issued from, and an ack
carries its op's transfer time. Each test was checked to fail, on an H200, with the code it
covers broken (the wait taken out, the wrong layer's event asked, no duration). Run under
compute-sanitizer by ``scripts/gpu_check.sh``."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import device_rows, gpu_backends, host_rows, make_controller
from gpu_shapes import scaled

from hicache.controller import CacheController, TransferBackend
from hicache.controller.events import LayerEventRing
from hicache.pools import HostLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# ~10 ms: a reader that does not wait reads the old value; ~0.5 s under the sanitizer,
# where the calls made while the stream sleeps can take longer than 10 ms
SLEEP_CYCLES = scaled(20_000_000, 1_000_000_000)
CUDA = torch.device("cuda")


def load_with_the_last_layer_late(ring: LayerEventRing, side: torch.cuda.Stream,
                                  value: torch.Tensor) -> int:
    """Take a set of ``ring`` and play a 4-layer load on ``side``: layers 0 to 2 arrived
    (their events fired, checked), then a sleep, ``value`` filled with 1, layer 3 recorded.
    Returns the set's index."""
    index, events = ring.acquire()
    with torch.cuda.stream(side):
        for layer in (0, 1, 2):
            events[layer].record(side)
    side.synchronize()
    assert all(events[layer].query() for layer in (0, 1, 2))
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        value.fill_(1.0)
        events[3].record(side)
    return index


def test_wait_until_waits_for_the_layer_asked_while_earlier_ones_arrived() -> None:
    ring = LayerEventRing(2, 4, CUDA)
    side, reader = torch.cuda.Stream(), torch.cuda.Stream()
    value = torch.zeros(1, device="cuda")
    ring.consumer = load_with_the_last_layer_late(ring, side, value)
    with torch.cuda.stream(reader):
        ring.wait_until(2)  # arrived: no wait needed (and none would change what is read)
        ring.wait_until(3)
        seen = value.clone()
    reader.synchronize()
    assert seen.item() == 1.0, "read before layer 3 arrived"


def test_a_ring_set_whose_load_runs_is_not_taken_again() -> None:
    ring = LayerEventRing(2, 4, CUDA)
    side = torch.cuda.Stream()
    value = torch.zeros(1, device="cuda")
    first = load_with_the_last_layer_late(ring, side, value)
    second, _ = ring.acquire()
    assert second != first
    with pytest.raises(RuntimeError, match=f"layer event set {first} is still in flight"):
        ring.acquire()
    side.synchronize()
    assert ring.acquire()[0] == first, "free again once its last layer arrived"


def test_a_late_ack_of_a_sets_earlier_load_does_not_free_it_from_its_running_load() -> None:
    """Set 0's first load finished (its last event fired) but its ack was not polled yet
    when the ring came round to set 0 again and a second, slow load took it. The first
    load's ack, polled then, must not mark set 0 free: the next turn of the ring still
    finds it in flight."""
    ring = LayerEventRing(2, 4, CUDA)
    side = torch.cuda.Stream()
    value = torch.zeros(1, device="cuda")
    first, events = ring.acquire()
    first_ticket = ring.taken(first)
    with torch.cuda.stream(side):
        for event in events:
            event.record(side)
    side.synchronize()
    second, _ = ring.acquire()
    ring.release(second, ring.taken(second))
    assert load_with_the_last_layer_late(ring, side, value) == first
    ring.release(first, first_ticket)  # the first load's ack, polled late
    assert ring.acquire()[0] == second
    with pytest.raises(RuntimeError, match=f"layer event set {first} is still in flight"):
        ring.acquire()
    side.synchronize()


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
def test_a_write_waits_for_every_producer_stream(backend: TransferBackend) -> None:
    """Two registered producers; the rows are written late on the second one."""
    ctrl = make_controller(backend, device="cuda", page_size=4, device_pages=16,
                           host_pages=32, num_layers=4, layout=HostLayout.LAYER_FIRST)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    ctrl.register_producer_stream(first)
    ctrl.register_producer_stream(second)
    ctrl.register_producer_stream(first)  # again: no second entry, no harm
    device = ctrl.device_allocator.try_alloc(8)
    assert device is not None
    index = device.tensor.cuda()
    with torch.cuda.stream(second):
        torch.cuda._sleep(SLEEP_CYCLES)
        # index_fill_: an indexed assignment would block the CPU until the sleep ends
        ctrl.device_pool.data.index_fill_(2, index, 7.0)
    host = ctrl.write(device)
    assert host is not None
    ctrl.drain()
    assert (host_rows(ctrl.host_pool)[host.tensor] == 7.0).all()


def test_acks_on_the_gpu_carry_their_transfer_time() -> None:
    ctrl = make_controller(gpu_backends()[0], device="cuda", page_size=4, device_pages=64,
                           host_pages=64, num_layers=4, layout=HostLayout.LAYER_FIRST)
    device = ctrl.device_allocator.try_alloc(128)
    assert device is not None
    rows = device_rows(ctrl.device_pool)[device.tensor]
    host = ctrl.write(device)
    assert host is not None
    (written,) = ctrl.drain()
    ctrl.evict_device(device)
    loaded = ctrl.load(host)
    assert loaded is not None
    (read,) = ctrl.drain()
    assert torch.equal(device_rows(ctrl.device_pool)[loaded.tensor], rows)
    for ack in (written, read):
        assert ack.duration_s is not None and 0.0 < ack.duration_s < 10.0, ack


def small_gpu_controller(backend: TransferBackend) -> CacheController:
    return make_controller(backend, device="cuda", page_size=4, device_pages=16,
                           host_pages=32, num_layers=4, layout=HostLayout.LAYER_FIRST)


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
def test_a_write_waits_for_the_stream_it_was_queued_on(backend: TransferBackend) -> None:
    """Queued on one stream (whose rows come late), issued from another, idle one."""
    ctrl = small_gpu_controller(backend)
    device = ctrl.device_allocator.try_alloc(8)
    assert device is not None
    index = device.tensor.cuda()
    queued_on, issuer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(queued_on):
        torch.cuda._sleep(SLEEP_CYCLES)
        ctrl.device_pool.data.index_fill_(2, index, 9.0)  # no CPU block (see above)
        host = ctrl.write(device)
        assert host is not None
    with torch.cuda.stream(issuer):
        ctrl.start_writing()
    ctrl.drain()
    assert (host_rows(ctrl.host_pool)[host.tensor] == 9.0).all()


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
def test_a_write_issued_from_a_busy_stream_copies_the_right_rows(
        backend: TransferBackend) -> None:
    """Queued on the default stream, issued from a stream that is still sleeping: what
    the issue puts on the issuing stream (index uploads) is waited for."""
    ctrl = small_gpu_controller(backend)
    device = ctrl.device_allocator.try_alloc(8)
    assert device is not None
    rows = device_rows(ctrl.device_pool)[device.tensor]
    host = ctrl.write(device)
    assert host is not None
    issuer = torch.cuda.Stream()
    with torch.cuda.stream(issuer):
        torch.cuda._sleep(SLEEP_CYCLES)
        ctrl.start_writing()
    ctrl.drain()
    assert torch.equal(host_rows(ctrl.host_pool)[host.tensor], rows)


def test_a_tensor_parallel_ranks_ring_waits_for_a_busy_set() -> None:
    """With ``wait_when_busy`` (a service of a tensor-parallel rank) the set whose load
    still runs is handed out once its last layer arrived: the CPU waited for it."""
    ring = LayerEventRing(2, 4, CUDA)
    ring.wait_when_busy = True
    side = torch.cuda.Stream()
    value = torch.zeros(1, device="cuda")
    first = load_with_the_last_layer_late(ring, side, value)
    ring.acquire()
    assert not side.query(), "the sleep ended before the busy set was asked for"
    assert ring.acquire()[0] == first
    assert side.query() and value.item() == 1.0
