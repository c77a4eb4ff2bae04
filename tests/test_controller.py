"""CacheController on a CPU: moved rows, sentinels, index handling and the ack protocol."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import pytest
import torch
from controller_helpers import (
    SENTINEL,
    device_rows,
    fill_unique,
    host_rows,
    make_controller,
    untouched,
)

from hicache.controller import (
    CacheController,
    Direction,
    Event,
    KernelBackend,
    MovedTransfer,
    TorchBackend,
    TransferBackend,
    make_backend,
)
from hicache.controller.direct import DirectBackend
from hicache.controller.kernel import INTERPRET_ENV, kernel_available
from hicache.controller.staged import StagedBackend
from hicache.controller.stats import FOLD_EVERY
from hicache.pools import AttentionKind, HostLayout, IndexSpace, Indices

PAGE_COUNTS = [1, 7, 8, 9, 63, 64, 65]


def backends() -> list[TransferBackend]:
    """Backends that serve these tests' CPU pools (the kernel only in the interpreter)."""
    found: list[TransferBackend] = [TorchBackend(), StagedBackend(staging_tokens=8),
                                    DirectBackend()]
    if kernel_available() and os.environ.get(INTERPRET_ENV) == "1":
        found.append(KernelBackend(num_programs=4))
    return found


def backend_id(backend: TransferBackend) -> str:
    return backend.name


class SpyBackend(TorchBackend):
    """Torch backend that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        self.calls += 1
        super().copy(moved, local_layers, direction, keep_alive)


@pytest.fixture
def pending_events(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make every event report 'not finished' until the test restores it."""
    monkeypatch.setattr(Event, "query", lambda self: False)
    yield


def round_trip(ctrl: CacheController, device: Indices) -> Indices:
    """Write ``device`` slots, evict them, wipe the pool, load them back; return new slots."""
    before = device_rows(ctrl.device_pool)
    host = ctrl.write(device, tag="w")
    assert host is not None
    ctrl.start_writing()
    assert [a.tags for a in ctrl.poll()] == [["w"]]
    rows = host_rows(ctrl.host_pool)
    assert torch.equal(rows[host.tensor], before[device.tensor.long()])
    assert (untouched(rows, host.tensor) == SENTINEL).all()
    ctrl.evict_device(Indices(device.tensor.long(), IndexSpace.DEVICE_FULL))
    ctrl.device_pool.data.fill_(SENTINEL)
    loaded = ctrl.load(host, tag="l")
    assert loaded is not None
    ctrl.start_loading()
    assert [a.tags for a in ctrl.poll()] == [["l"]]
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[loaded.tensor], before[device.tensor.long()])
    assert (untouched(after, loaded.tensor) == SENTINEL).all()
    return loaded


@pytest.mark.parametrize("backend", backends(), ids=backend_id)
@pytest.mark.parametrize("num_pages", PAGE_COUNTS)
def test_round_trip_page_counts(backend: TransferBackend, num_pages: int) -> None:
    """Rows written then loaded back equal the source; every other row keeps the sentinel."""
    ctrl = make_controller(backend, page_size=2)
    ctrl.device_allocator.try_alloc(6)  # so device and host slot ids differ
    device = ctrl.device_allocator.try_alloc(2 * num_pages)
    assert device is not None
    round_trip(ctrl, device)
    ctrl.device_allocator.check_integrity()
    ctrl.host_pool.allocator.check_integrity()


@pytest.mark.parametrize("backend", backends(), ids=backend_id)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda x: x.value)
def test_round_trip_layouts_and_kinds(
    backend: TransferBackend, layout: HostLayout, kind: AttentionKind
) -> None:
    """Both host layouts, MHA and MLA rows, a shuffled slot order."""
    ctrl = make_controller(backend, page_size=1, layout=layout, kind=kind)
    device = ctrl.device_allocator.try_alloc(20)
    assert device is not None
    shuffled = device.tensor[torch.randperm(20, generator=torch.Generator().manual_seed(3))]
    round_trip(ctrl, Indices(shuffled, IndexSpace.DEVICE_FULL))


@pytest.mark.parametrize("backend", backends(), ids=backend_id)
def test_int32_indices(backend: TransferBackend) -> None:
    """int32 device indices from the caller move the same rows as int64."""
    ctrl = make_controller(backend)
    device = ctrl.device_allocator.try_alloc(9)
    assert device is not None
    round_trip(ctrl, Indices(device.tensor.to(torch.int32), IndexSpace.DEVICE_FULL))


def test_bfloat16_rows() -> None:
    """bf16 rows survive the round trip bit for bit."""
    ctrl = make_controller(TorchBackend(), dtype=torch.bfloat16)
    ctrl.device_pool.data.normal_()
    device = ctrl.device_allocator.try_alloc(11)
    assert device is not None
    round_trip(ctrl, device)


def test_empty_ops_launch_nothing() -> None:
    """Empty writes and loads return empty indices and never reach the backend."""
    spy = SpyBackend()
    ctrl = make_controller(spy)
    empty = Indices(torch.empty(0, dtype=torch.int64), IndexSpace.DEVICE_FULL)
    host = ctrl.write(empty)
    assert host is not None and len(host) == 0
    ctrl.start_writing()
    loaded = ctrl.load(Indices(torch.empty(0, dtype=torch.int64), IndexSpace.HOST_FULL))
    assert loaded is not None and len(loaded) == 0
    assert ctrl.start_loading() is None
    assert ctrl.poll() == []
    assert spy.calls == 0
    assert sum(ctrl.stats.ops_submitted.values()) == 0


def test_writes_merge_into_one_op() -> None:
    """Queued writes become one transfer whose ack carries every tag in order."""
    spy = SpyBackend()
    ctrl = make_controller(spy)
    for tag in ("a", "b", "c"):
        device = ctrl.device_allocator.try_alloc(3)
        assert device is not None and ctrl.write(device, tag=tag) is not None
    ctrl.start_writing()
    acks = ctrl.poll()
    assert [a.tags for a in acks] == [["a", "b", "c"]]
    assert acks[0].tokens_by_pool == {"full": 9}
    assert spy.calls == 1


def test_load_issues_layer_0_then_the_rest() -> None:
    """A 5-layer load of a few tiny rows: layer 0 alone, then one copy of the other four
    (each copy costs more CPU than its rows take on the link, controller/load_groups.py)."""
    spy = SpyBackend()
    ctrl = make_controller(spy, num_layers=5)
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    host = ctrl.write(device)
    ctrl.start_writing()
    ctrl.poll()
    spy.calls = 0
    assert host is not None and ctrl.load(host) is not None
    assert ctrl.start_loading() == 0
    assert spy.calls == 2


def test_acks_fifo_per_direction(pending_events: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Acks come in submission order and only once the events report done."""
    ctrl = make_controller(TorchBackend())
    for tag in ("first", "second", "third"):
        device = ctrl.device_allocator.try_alloc(2)
        assert device is not None and ctrl.write(device, tag=tag) is not None
        ctrl.start_writing()
    assert ctrl.poll() == []
    assert ctrl.stats.in_flight_ops == 3
    monkeypatch.setattr(Event, "query", lambda self: True)
    assert [a.tags for a in ctrl.poll()] == [["first"], ["second"], ["third"]]
    assert ctrl.stats.in_flight_ops == 0


def test_event_ring_reuse_raises(pending_events: None) -> None:
    """A fourth load while three event sets are still in flight raises, never hangs."""
    ctrl = make_controller(TorchBackend())
    host = ctrl.host_pool.allocator.try_alloc(8)
    assert host is not None
    for i in range(3):
        part = Indices(host.tensor[2 * i: 2 * i + 2], IndexSpace.HOST_FULL)
        assert ctrl.load(part) is not None
        assert ctrl.start_loading() == i
    assert ctrl.load(Indices(host.tensor[6:8], IndexSpace.HOST_FULL)) is not None
    with pytest.raises(RuntimeError, match="event set 0 is still in flight"):
        ctrl.start_loading()


def test_ring_set_reused_after_ack() -> None:
    """Once acknowledged, event sets rotate freely."""
    ctrl = make_controller(TorchBackend())
    host = ctrl.host_pool.allocator.try_alloc(10)
    assert host is not None
    for i in range(5):
        assert ctrl.load(Indices(host.tensor[2 * i: 2 * i + 2], IndexSpace.HOST_FULL))
        assert ctrl.start_loading() == i % 3
        assert len(ctrl.poll()) == 1


def test_in_flight_slots_cannot_be_evicted(pending_events: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Host and device slots of an unacknowledged op refuse eviction until the ack."""
    ctrl = make_controller(TorchBackend())
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    host = ctrl.write(device)
    assert host is not None
    ctrl.start_writing()
    assert ctrl.is_in_flight(host) and ctrl.is_in_flight(device)
    with pytest.raises(ValueError, match="in flight"):
        ctrl.evict_host(host)
    with pytest.raises(ValueError, match="in flight"):
        ctrl.evict_device(device)
    monkeypatch.setattr(Event, "query", lambda self: True)
    assert len(ctrl.poll()) == 1
    ctrl.evict_host(host)
    ctrl.evict_device(device)
    assert ctrl.host_pool.allocator.num_used_tokens == 0


def test_queued_slots_are_busy_before_start() -> None:
    """A queued (not yet started) write already protects its slots."""
    ctrl = make_controller(TorchBackend())
    device = ctrl.device_allocator.try_alloc(2)
    assert device is not None
    host = ctrl.write(device)
    assert host is not None
    with pytest.raises(ValueError, match="in flight"):
        ctrl.evict_host(host)
    assert len(ctrl.drain()) == 1


def test_write_returns_none_when_host_full() -> None:
    """No host room: write returns None and queues nothing."""
    ctrl = make_controller(TorchBackend(), host_pages=4)
    device = ctrl.device_allocator.try_alloc(6)
    assert device is not None
    assert ctrl.write(device) is None
    assert ctrl.num_in_flight == 0
    assert ctrl.host_pool.allocator.num_used_tokens == 0


def test_load_returns_none_when_device_full() -> None:
    """No device room: load returns None and allocates nothing."""
    ctrl = make_controller(TorchBackend(), device_pages=4)
    host = ctrl.host_pool.allocator.try_alloc(6)
    assert host is not None
    assert ctrl.load(host) is None
    assert ctrl.device_allocator.num_used_tokens == 0


def test_move_indices_drops_padding_and_casts() -> None:
    """Pairs touching slot 0 are dropped; results are int64 on the backend's devices."""
    ctrl = make_controller(TorchBackend())
    host = Indices(torch.tensor([3, 0, 5, 6], dtype=torch.int32), IndexSpace.HOST_FULL)
    device = Indices(torch.tensor([7, 8, 0, 9], dtype=torch.int64), IndexSpace.DEVICE_FULL)
    host_index, device_index = ctrl.move_indices(host, device)
    assert host_index.tolist() == [3, 6] and device_index.tolist() == [7, 9]
    assert host_index.dtype == device_index.dtype == torch.int64


def test_move_indices_rejects_bad_input() -> None:
    """Length mismatch, swapped spaces and non-CPU indices raise with the reason."""
    ctrl = make_controller(TorchBackend())
    host = Indices(torch.tensor([1, 2]), IndexSpace.HOST_FULL)
    device = Indices(torch.tensor([1]), IndexSpace.DEVICE_FULL)
    with pytest.raises(ValueError, match="2 host indices but 1 device"):
        ctrl.move_indices(host, device)
    with pytest.raises(ValueError, match="expected \\(host, device\\)"):
        ctrl.move_indices(Indices(torch.tensor([1]), IndexSpace.DEVICE_FULL), device)
    meta = Indices(torch.empty(1, dtype=torch.int64, device="meta"), IndexSpace.HOST_FULL)
    with pytest.raises(ValueError, match="must be on cpu"):
        ctrl.move_indices(meta, device)


def test_write_rejects_wrong_space() -> None:
    """Host indices handed to write() raise naming the expected space."""
    ctrl = make_controller(TorchBackend())
    with pytest.raises(ValueError, match="takes indices in space DEVICE_FULL, got HOST_FULL"):
        ctrl.write(Indices(torch.tensor([1, 2]), IndexSpace.HOST_FULL))
    with pytest.raises(ValueError, match="takes indices in space HOST_FULL, got DEVICE_SWA"):
        ctrl.load(Indices(torch.tensor([1, 2]), IndexSpace.DEVICE_SWA))


def test_out_of_range_index_without_debug_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With HICACHE_DEBUG_CHECKS unset an out-of-range slot names the pool, value and bound."""
    monkeypatch.delenv("HICACHE_DEBUG_CHECKS", raising=False)
    ctrl = make_controller(TorchBackend(), device_pages=8)
    with pytest.raises(ValueError, match=r"slot 99 is out of range for pool 'full'.*0\.\.8"):
        ctrl.write(Indices(torch.tensor([99]), IndexSpace.DEVICE_FULL))


def test_layer_waiter_wired_through_accessors() -> None:
    """A pool's layer waiter set to wait_until is called by every KV accessor."""
    ctrl = make_controller(TorchBackend())
    seen: list[int] = []
    ctrl.device_pool.register_layer_waiter(lambda layer: (seen.append(layer),
                                                          ctrl.wait_until(layer)))
    ctrl.device_pool.key_buffer(2)
    ctrl.device_pool.value_buffer(1)
    assert seen == [2, 1]


def test_wait_until_rejects_bad_layer() -> None:
    """wait_until on a layer the model does not have raises, before any load (an engine's
    bug shows on its first forward, not its first host hit) and once a load exists."""
    ctrl = make_controller(TorchBackend(), num_layers=2)
    ctrl.wait_until(1)  # no load yet: nothing to wait for
    with pytest.raises(ValueError, match="layer 7 out of range"):
        ctrl.wait_until(7)
    host = ctrl.host_pool.allocator.try_alloc(1)
    assert host is not None and ctrl.load(host) is not None
    ctrl.start_loading()
    with pytest.raises(ValueError, match="layer 7 out of range"):
        ctrl.wait_until(7)


def test_drain_finishes_queued_work() -> None:
    """drain() issues queued writes and loads and acknowledges everything."""
    ctrl = make_controller(TorchBackend())
    device = ctrl.device_allocator.try_alloc(2)
    assert device is not None
    assert ctrl.write(device, tag="w") is not None
    host = ctrl.host_pool.allocator.try_alloc(2)  # the write's own host slots would be refused
    assert host is not None
    assert ctrl.load(host, tag="l") is not None
    directions = [a.direction for a in ctrl.drain()]
    assert directions == [Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE]
    assert ctrl.num_in_flight == 0


def test_stats_count_tokens_and_bytes() -> None:
    """Acks add tokens and bytes per direction and pool."""
    ctrl = make_controller(TorchBackend(), num_layers=3)
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    ctrl.write(device)
    ctrl.drain()
    row_bytes = 8 * 4  # 2 heads x 4 dims float32
    assert ctrl.stats.tokens[("device_to_host", "full")] == 4
    assert ctrl.stats.bytes[("device_to_host", "full")] == 4 * 3 * 2 * row_bytes


def test_stats_fold_acks_when_read_and_in_batches() -> None:
    """An ack is only appended on ``poll``; the counters read it (and drained durations)
    all the same, and unread acks are folded every ``FOLD_EVERY``, so none pile up."""
    count = FOLD_EVERY + 5
    ctrl, _ = _backed_up(1, count)
    assert len(ctrl.stats._unfolded) == 5  # the fold at FOLD_EVERY acks, then five more
    assert ctrl.stats.ops_acknowledged["device_to_host"] == count
    assert ctrl.stats.tokens[("device_to_host", "full")] == count
    assert ctrl.stats.in_flight_ops == 0 and not ctrl.stats._unfolded
    assert ctrl.stats.drain_durations() == []  # CPU ops carry no device timing


def test_make_backend_choices() -> None:
    """auto is torch on a CPU; torch builds anywhere; unknown names raise (refusals of
    kernel and staged for CPU pools: test_controller_refusals.py)."""
    assert make_backend("auto", torch.device("cpu")).name == "torch"
    assert make_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError):
        make_backend("nonsense", torch.device("cpu"))
    with pytest.raises(ValueError, match="num_programs must be >= 1"):
        KernelBackend(0)


def test_fill_unique_is_unique() -> None:
    """The helper gives every element a distinct value (guards the other tests)."""
    data = torch.empty(2, 3, 5, 8)
    fill_unique(data)
    assert data.unique().numel() == data.numel()


def test_stats_fold_submissions_when_read_and_in_batches() -> None:
    """An op's submission is only appended at ``start_writing``; the counters read it (ops,
    backend, host runs and their tokens) all the same, and unread submissions fold every
    ``FOLD_EVERY``, so none pile up; the op's index tensors are not kept for the fold."""
    count = FOLD_EVERY + 3
    ctrl, _ = _backed_up(2, count)
    submits = ctrl.stats._unfolded_submits
    assert len(submits) == 3  # the fold at FOLD_EVERY submissions, then three more
    assert not any(isinstance(item, torch.Tensor) for entry in submits for item in entry)
    assert ctrl.stats.ops_submitted["device_to_host"] == count
    assert ctrl.stats.backend_ops[("device_to_host", "torch")] == count
    key = ("device_to_host", "full")
    assert ctrl.stats.host_runs[key] == count  # each op's two host pages are one run
    assert ctrl.stats.host_run_tokens[key] == 2 * count
    assert ctrl.stats.mean_host_run_tokens("device_to_host", "full") == 2.0
    assert ctrl.stats.in_flight_ops == 0 and not submits


def test_submissions_folded_by_a_reader_on_another_thread_are_counted_once() -> None:
    """A metrics reader folds submissions on its own thread while the scheduler submits
    and acknowledges ops: every op is counted once, and no read counts more acks than
    submissions."""
    import sys
    import threading

    ctrl, device = _backed_up(1, 0)
    stats, total, done = ctrl.stats, 3 * FOLD_EVERY, threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while not done.is_set():
                assert stats.in_flight_ops >= 0
                assert sum(stats.host_runs.values()) <= total
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        _back_up(ctrl, device, total)
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(switch)
    assert not errors, errors
    assert stats.ops_submitted["device_to_host"] == total
    assert stats.host_runs[("device_to_host", "full")] == total
    assert stats.ops_acknowledged["device_to_host"] == total and stats.in_flight_ops == 0



def _backed_up(pages: int, count: int) -> tuple[CacheController, Indices]:
    """A one-layer CPU controller (pages of one slot) and ``pages`` of its device pages,
    after :func:`_back_up` of them ``count`` times."""
    ctrl = make_controller(TorchBackend(), num_layers=1, device_pages=8, host_pages=8)
    device = ctrl.device_allocator.try_alloc(pages)
    assert device is not None
    _back_up(ctrl, device, count)
    return ctrl, device


def _back_up(ctrl: CacheController, device: Indices, count: int) -> None:
    """``count`` backups of ``device``, each written, acknowledged and its host copy freed."""
    for _ in range(count):
        host = ctrl.write(device)
        assert host is not None
        ctrl.start_writing()
        ctrl.poll()
        ctrl.evict_host(host)


@pytest.mark.parametrize("backend", backends(), ids=backend_id)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_a_single_token_moves_both_ways(backend: TransferBackend, layout: HostLayout) -> None:
    """An op of one pair (pages of one token): written, evicted, loaded back: exactly that
    row on each side, nothing else touched."""
    ctrl = make_controller(backend, layout=layout)
    ctrl.device_allocator.try_alloc(5)  # not the first slots
    device = ctrl.device_allocator.try_alloc(1)
    assert device is not None and len(device) == 1
    round_trip(ctrl, device)
