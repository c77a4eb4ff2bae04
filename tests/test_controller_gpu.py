"""CacheController on a real GPU: side streams, producer streams, lifetimes under churn."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import (
    SENTINEL,
    check_layer_by_layer,
    device_rows,
    gpu_backends,
    host_rows,
    make_controller,
    make_hybrid,
    written_and_wiped,
)

from hicache.controller import (
    CacheController,
    HybridSlots,
    TransferBackend,
)
from hicache.pools import HostLayout, IndexSpace, Indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLEEP_CYCLES = 20_000_000  # ~10 ms on a current GPU: keeps a side stream busy
# NO_CPU_BLOCK: rows written behind a sleep are written with ``index_fill_``. An indexed
# assignment (``data[:, :, index] = v``) blocks the CPU until the stream's sleep is over (101
# ms of a 100 ms sleep, measured on an H200), and a test written so passes with no wait at
# all. (The torch backend's GPU write allocates pinned memory, which waits for the device:
# there such a test passes either way; the other backends are what it checks.)


def churn_allocator(rounds: int = 8) -> None:
    """Allocate, scribble on and free CUDA memory so freed blocks get reused at once."""
    for i in range(rounds):
        junk = torch.empty(1 << (12 + i % 6), dtype=torch.int64, device="cuda")
        junk.fill_(-(10**12) - i)
        del junk


def gpu_controller(backend: TransferBackend, layout: HostLayout) -> CacheController:
    ctrl = make_controller(backend, device="cuda", page_size=4, device_pages=64, host_pages=160,
                           num_layers=4, layout=layout, dtype=torch.bfloat16)
    ctrl.device_pool.data.copy_(
        torch.randn(ctrl.device_pool.data.shape, device="cuda").to(torch.bfloat16))
    return ctrl


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_dropped_indices_survive_allocator_churn(backend: TransferBackend,
                                                 layout: HostLayout) -> None:
    """The caller drops every index right after submitting while the caching allocator
    churns; side streams held back by a busy producer still read the right indices."""
    ctrl = gpu_controller(backend, layout)
    producer = torch.cuda.Stream()
    ctrl.register_producer_stream(producer)
    expected: list[tuple[Indices, torch.Tensor]] = []
    for _ in range(6):
        device = ctrl.device_allocator.try_alloc(16)
        assert device is not None
        rows = device_rows(ctrl.device_pool)[device.tensor]
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SLEEP_CYCLES)
        host = ctrl.write(device)
        assert host is not None
        ctrl.start_writing()
        expected.append((host, rows))
        del device
        churn_allocator()
    ctrl.drain()
    snapshot = host_rows(ctrl.host_pool)
    for host, rows in expected:
        assert torch.equal(snapshot[host.tensor], rows)
    loads = []
    for i, (host, rows) in enumerate(expected):
        if i % ctrl.layer_events.num_sets == 0:
            ctrl.drain()  # the ring holds this many load batches in flight
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SLEEP_CYCLES)
        loaded = ctrl.load(host)
        assert loaded is not None
        ctrl.start_loading()
        loads.append((loaded, rows))
        churn_allocator()
        ctrl.poll()
    ctrl.drain()
    after = device_rows(ctrl.device_pool)
    for loaded, rows in loads:
        assert torch.equal(after[loaded.tensor], rows)


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
def test_write_waits_for_producer_stream(backend: TransferBackend) -> None:
    """KV written on the forward stream just before write() is what gets backed up."""
    ctrl = gpu_controller(backend, HostLayout.LAYER_FIRST)
    forward = torch.cuda.Stream()
    ctrl.register_producer_stream(forward)
    device = ctrl.device_allocator.try_alloc(8)
    assert device is not None
    index = device.tensor.cuda()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(SLEEP_CYCLES)
        ctrl.device_pool.data.index_fill_(2, index, 3.0)  # see NO_CPU_BLOCK
    host = ctrl.write(device)
    assert host is not None
    ctrl.start_writing()
    ctrl.drain()
    assert (host_rows(ctrl.host_pool)[host.tensor] == 3.0).all()


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
def test_write_waits_for_callers_stream(backend: TransferBackend) -> None:
    """KV written on the caller's own (unregistered, busy) stream right before write() is what
    gets backed up: the side stream waits on the stream that was current at submission."""
    ctrl = gpu_controller(backend, HostLayout.PAGE_FIRST)
    device = ctrl.device_allocator.try_alloc(8)
    assert device is not None
    index = device.tensor.cuda()
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        torch.cuda._sleep(SLEEP_CYCLES)
        ctrl.device_pool.data.index_fill_(2, index, 5.0)  # see NO_CPU_BLOCK
        host = ctrl.write(device)
        assert host is not None
        ctrl.start_writing()
    ctrl.drain()
    assert (host_rows(ctrl.host_pool)[host.tensor] == 5.0).all()


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT],
                         ids=lambda layout: layout.value)
def test_interleaved_moves_with_concurrent_forward(backend: TransferBackend,
                                                   layout: HostLayout) -> None:
    """Writes and loads interleave on real streams while a forward stream writes other
    slots; moved rows are exact and the forward's rows are untouched."""
    ctrl = gpu_controller(backend, layout)
    forward = torch.cuda.Stream()
    ctrl.register_producer_stream(forward)
    other = ctrl.device_allocator.try_alloc(32)
    assert other is not None
    other_index = other.tensor.cuda()
    generator = torch.Generator().manual_seed(0)
    backed: list[tuple[Indices, torch.Tensor]] = []
    loaded: list[tuple[Indices, torch.Tensor]] = []
    for step in range(24):
        with torch.cuda.stream(forward):
            ctrl.device_pool.data[:, :, other_index] = float(step)
        # Only acknowledged backups can be loaded (the load stream does not wait for the
        # write stream, so the controller refuses a host page a write still fills).
        ready = [entry for entry in backed if not ctrl.is_in_flight(entry[0])]
        if step % 3 != 2 or not ready:
            device = ctrl.device_allocator.try_alloc(8)
            assert device is not None
            rows = device_rows(ctrl.device_pool)[device.tensor]
            host = ctrl.write(device)
            assert host is not None
            ctrl.start_writing()
            backed.append((host, rows))
        else:
            pick = int(torch.randint(len(ready), (1,), generator=generator))
            host, rows = ready[pick]
            target = ctrl.load(host)
            if target is not None:
                ctrl.start_loading()
                loaded.append((target, rows))
        ctrl.poll()
    ctrl.drain()
    forward.synchronize()
    after = device_rows(ctrl.device_pool)
    snapshot = host_rows(ctrl.host_pool)
    for host, rows in backed:
        assert torch.equal(snapshot[host.tensor], rows)
    for target, rows in loaded:
        assert torch.equal(after[target.tensor], rows)
    assert (after[other.tensor] == 23.0).all()


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST_DIRECT],
                         ids=lambda layout: layout.value)
def test_layer_wise_wait_until(backend: TransferBackend, layout: HostLayout) -> None:
    """A forward stream that waits per layer reads loaded rows, never stale ones."""
    ctrl = gpu_controller(backend, layout)
    host, rows = written_and_wiped(ctrl, 64)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(ctrl.load_stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the load starts late
    target = ctrl.load(host)
    assert target is not None
    ctrl.start_loading()
    check_layer_by_layer(ctrl, target, rows, forward)
    ctrl.drain()


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT],
                         ids=lambda layout: layout.value)
def test_hybrid_round_trip_on_gpu(backend: TransferBackend, layout: HostLayout) -> None:
    """Hybrid write, evict, load on real streams restores full rows and the SWA tail."""
    ctrl = make_hybrid(backend, device="cuda", layout=layout)
    pool = ctrl.hybrid_pool
    assert pool.try_alloc(4) is not None
    full = pool.try_alloc(10)
    assert full is not None
    pool.free_swa(Indices(full.tensor[:6], IndexSpace.DEVICE_FULL))
    swa_before = pool.swa_slots_of(full).tensor
    full_rows = device_rows(pool.full)[full.tensor]
    swa_rows = device_rows(pool.swa)
    host = ctrl.write(full)
    assert host is not None
    ctrl.start_writing()
    churn_allocator()
    ctrl.drain()
    ctrl.evict_device(full)
    pool.full.data.fill_(SENTINEL)
    pool.swa.data.fill_(SENTINEL)
    back = ctrl.load(host.full, host.swa, swa_tail_tokens=4)
    assert back is not None
    ctrl.start_loading()
    churn_allocator()
    ctrl.drain()
    tail = back.swa.tensor != 0
    assert torch.equal(device_rows(pool.full)[back.full.tensor], full_rows)
    assert torch.equal(device_rows(pool.swa)[back.swa.tensor[tail]], swa_rows[swa_before[tail]])
    pool.check_integrity()



@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda layout: layout.value)
def test_swa_history_round_trip_on_gpu(backend: TransferBackend, layout: HostLayout) -> None:
    """SWA rows that leave the window go to the host on their own (``write_swa``); a later
    load brings back a host span and, in the same op, restores the SWA rows of device
    tokens before it (``restore=``): every row is compared on real streams."""
    ctrl = make_hybrid(backend, device="cuda", layout=layout)
    pool = ctrl.hybrid_pool
    assert pool.try_alloc(4) is not None  # the span does not start at the first pages
    prefix = pool.try_alloc(6)  # stays on the device; its SWA rows leave
    span = pool.try_alloc(4)  # goes to the host and comes back
    assert prefix is not None and span is not None
    prefix_swa = device_rows(pool.swa)[pool.swa_slots_of(prefix).tensor]
    span_full = device_rows(pool.full)[span.tensor]
    span_swa = device_rows(pool.swa)[pool.swa_slots_of(span).tensor]
    host_prefix_swa = ctrl.write_swa(prefix)
    host_span = ctrl.write(span)
    assert host_prefix_swa is not None and host_span is not None
    ctrl.start_writing()
    churn_allocator()
    ctrl.drain()
    pool.free_swa(prefix)
    ctrl.evict_device(span)
    pool.full.data.fill_(SENTINEL)
    pool.swa.data.fill_(SENTINEL)
    back = ctrl.load(host_span.full, host_span.swa, swa_tail_tokens=4,
                     restore=HybridSlots(prefix, host_prefix_swa))
    assert back is not None
    ctrl.start_loading()
    churn_allocator()
    ctrl.drain()
    assert torch.equal(device_rows(pool.full)[back.full.tensor], span_full)
    assert torch.equal(device_rows(pool.swa)[back.swa.tensor], span_swa)
    assert torch.equal(device_rows(pool.swa)[pool.swa_slots_of(prefix).tensor], prefix_swa)
    ctrl.evict_host(host_span.full, host_span.swa)
    ctrl.host_swa_evict(host_prefix_swa)
    pool.check_integrity()
