"""An op whose issue raised half way, on a GPU: the copies issued before the error still run
on the side stream (held back here behind a busy producer), so every index tensor they read
must stay recorded on that stream while the caching allocator hands freed blocks out again.
The op is queued again; its retry brings the right rows, and no other row is touched.

The row checks held on an H200 with the record taken out too (the blocks the failed op
freed were not handed out again in time there), so the record itself is checked directly:
the failed op's tensors are recorded on its side stream before the error leaves."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from controller_helpers import (
    device_rows,
    gpu_backends,
    host_rows,
    make_controller,
    make_hybrid,
    written_and_wiped,
)

from hicache.controller import Direction, TransferBackend, side_streams
from hicache.pools import HostLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLEEP_CYCLES = 100_000_000  # ~50 ms: the side stream waits on the producer that long


class Boom(RuntimeError):
    """An injected failure of one copy call (as a staging allocation out of memory)."""


def fail_call(backend: TransferBackend, direction: Direction, at: int) -> Callable[[], None]:
    """Make the ``at``-th copy call (``copy`` or ``copy_counted``, from 0) of ``direction``
    on ``backend`` raise :class:`Boom`, once; returns a function that undoes it."""
    calls = [0]
    originals: dict[str, Any] = {}

    def wrap(name: str) -> None:
        original = originals[name] = getattr(backend, name)

        def failing(moved: Any, *args: Any) -> Any:
            is_load = name == "copy_counted" or args[1] is Direction.HOST_TO_DEVICE
            if (direction is Direction.HOST_TO_DEVICE) == is_load:
                calls[0] += 1
                if calls[0] == at + 1:
                    raise Boom(f"copy call {at} failed")
            return original(moved, *args)

        setattr(backend, name, failing)

    wrap("copy")
    wrap("copy_counted")

    def undo() -> None:
        for name in originals:
            delattr(backend, name)

    return undo


def reuse_freed_blocks(slot: int) -> None:
    """Allocate small int64 tensors of every size an op's indices have, filled with
    ``slot``, and free them: a block freed without being recorded on the side stream is
    handed out here at once and overwritten."""
    for _ in range(4):
        junk = [torch.full((n,), slot, dtype=torch.int64, device="cuda")
                for n in range(1, 300)]
        del junk


def held_producer(ctrl: Any) -> torch.cuda.Stream:
    producer = torch.cuda.Stream()
    ctrl.register_producer_stream(producer)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP_CYCLES)
    return producer


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
def test_a_load_that_raised_after_its_first_group_keeps_its_indices(
        backend: TransferBackend) -> None:
    ctrl = make_controller(backend, device="cuda", page_size=4, device_pages=64,
                           host_pages=160, num_layers=6, layout=HostLayout.LAYER_FIRST,
                           dtype=torch.bfloat16)
    host, rows = written_and_wiped(ctrl, 64)
    target = ctrl.load(host)
    assert target is not None
    before = device_rows(ctrl.device_pool)
    held_producer(ctrl)
    undo = fail_call(backend, Direction.HOST_TO_DEVICE, at=1)
    with pytest.raises(Boom):
        ctrl.start_loading()  # layer 0's copy is issued, behind the producer's sleep
    undo()
    gc.collect()  # the failed op and its traceback are gone
    reuse_freed_blocks(slot=5)  # slot 5: one of written_and_wiped's unused padding pages
    assert ctrl.start_loading() is not None
    ctrl.drain()
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[target.tensor], rows)
    others = torch.ones(after.shape[0], dtype=torch.bool)
    others[target.tensor] = False
    assert torch.equal(after[others], before[others])


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
def test_a_hybrid_write_that_raised_between_its_pools_keeps_its_indices(
        backend: TransferBackend) -> None:
    ctrl = make_hybrid(backend, device="cuda", page_size=4, full_pages=32, swa_pages=24,
                       host_pages=64)
    pool = ctrl.hybrid_pool
    assert pool.try_alloc(8) is not None  # pages ahead of the written ones
    full = pool.try_alloc(48)
    assert full is not None
    host = ctrl.write(full)
    assert host is not None
    host_before = (host_rows(ctrl.host_pool), host_rows(ctrl.host_swa))
    held_producer(ctrl)
    undo = fail_call(backend, Direction.DEVICE_TO_HOST, at=1)
    with pytest.raises(Boom):
        ctrl.start_writing()  # the full pool's copy is issued, the SWA pool's raised
    undo()
    gc.collect()
    reuse_freed_blocks(slot=1)
    ctrl.start_writing()
    ctrl.drain()
    full_host, swa_host = host_rows(ctrl.host_pool), host_rows(ctrl.host_swa)
    assert torch.equal(full_host[host.full.tensor], device_rows(pool.full)[full.tensor])
    kept = host.swa.tensor != 0
    swa = pool.swa_slots_of(full).tensor
    assert torch.equal(swa_host[host.swa.tensor[kept]], device_rows(pool.swa)[swa[kept]])
    for now, then, written in ((full_host, host_before[0], host.full.tensor),
                               (swa_host, host_before[1], host.swa.tensor[kept])):
        others = torch.ones(now.shape[0], dtype=torch.bool)
        others[written] = False
        assert torch.equal(now[others], then[others])


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_a_failed_issue_records_its_tensors_on_the_side_stream(
        backend: TransferBackend, direction: Direction, monkeypatch: pytest.MonkeyPatch) -> None:
    ctrl = make_hybrid(backend, device="cuda", page_size=4, full_pages=32, swa_pages=24,
                       host_pages=64)
    pool = ctrl.hybrid_pool
    full = pool.try_alloc(16)
    assert full is not None
    host = ctrl.write(full)
    assert host is not None
    ctrl.drain()
    if direction is Direction.HOST_TO_DEVICE:
        ctrl.evict_device(full)
        assert ctrl.load(host.full, host.swa, 16) is not None
    else:
        again = pool.try_alloc(16)
        assert again is not None and ctrl.write(again) is not None
    recorded: list[tuple[int, torch.cuda.Stream]] = []
    record = side_streams.record_on_stream

    def noted(op: Any, stream: torch.cuda.Stream) -> None:
        recorded.append((op.op_id, stream))
        record(op, stream)

    monkeypatch.setattr(side_streams, "record_on_stream", noted)
    undo = fail_call(backend, direction, at=1)
    with pytest.raises(Boom):
        if direction is Direction.HOST_TO_DEVICE:
            ctrl.start_loading()
        else:
            ctrl.start_writing()
    undo()
    side = ctrl.load_stream if direction is Direction.HOST_TO_DEVICE else ctrl.write_stream
    assert len(recorded) == 1 and recorded[0][1] == side
    ctrl.drain()
    assert ctrl.num_in_flight == 0


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
def test_a_write_whose_issue_raised_frees_its_caller_marks_once(
        backend: TransferBackend) -> None:
    """The events a write waits on (recorded where its calls were queued) go back to the
    free list when the write is issued, once: before, the failed issue freed them and the
    requeued calls kept them, so the retry freed them again, and two later writes queued on
    two streams could share one event (the first would wait on the other's stream)."""
    ctrl = make_controller(backend, device="cuda", page_size=4, device_pages=64,
                           host_pages=160, num_layers=2)
    first = ctrl.device_allocator.try_alloc(8)
    assert first is not None and ctrl.write(first) is not None
    undo = fail_call(backend, Direction.DEVICE_TO_HOST, at=0)
    with pytest.raises(Boom):
        ctrl.start_writing()
    undo()
    ctrl.start_writing()
    ctrl.drain()
    free = ctrl._streams._free_marks
    assert len(free) == len({id(event) for event in free})
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    for stream in streams:
        slots = ctrl.device_allocator.try_alloc(8)
        assert slots is not None
        with torch.cuda.stream(stream):
            assert ctrl.write(slots) is not None
    marks = [call.after for call in ctrl._ops.queued[Direction.DEVICE_TO_HOST]]
    assert marks[0][-1] is not marks[1][-1]
    ctrl.drain()
