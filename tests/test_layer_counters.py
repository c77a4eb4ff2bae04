"""Counted layer-wise loads on a CPU: the row kernel's counted launch (Triton interpreter)
adds its items per layer to exactly its layers' counters and moves the same rows as an
uncounted one; the counters' targets wrap as the device's int32 counters do; a counted
event answers the CPU through its leader; and without CUDA or with the driver's call
turned off nothing is counted (the GPU half is ``test_layer_counters_gpu.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_kernel import (
    INTERPRETED,
    canonical,
    expected_after,
    fill_pattern,
    make_buffer,
    random_pairs,
)

from hicache.controller import layer_counters
from hicache.controller.events import Event
from hicache.controller.kernel import kernel_available
from hicache.controller.layer_counters import LayerCounters
from hicache.controller.load_groups import local_groups
from hicache.controller.row_copy import RowCopy
from hicache.controller.side_streams import SideStreams
from hicache.pools import HostLayout

needs_kernel = pytest.mark.skipif(not (INTERPRETED and kernel_available()),
                                  reason="needs Triton and TRITON_INTERPRET=1")


def _copy(layout: HostLayout, num_pairs: int, layers: int = 5,
          tile: int = 4) -> tuple[RowCopy, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    device = make_buffer(2, layers, 80, 8, HostLayout.LAYER_FIRST, torch.float32)
    host = make_buffer(2, layers, 96, 8, layout, torch.float32)
    fill_pattern(host, layout)
    host_index, device_index = random_pairs(num_pairs, seed=3)
    copy = RowCopy(device_data=device, host_data=host, host_layout=layout,
                   host_indices=host_index, device_indices=device_index, to_host=False,
                   num_programs=3, tokens_per_tile=tile)
    return copy, device, host, host_index, device_index


@needs_kernel
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("num_pairs", [1, 7, 9, 30])
def test_a_counted_launch_counts_its_layers_and_moves_the_rows(layout: HostLayout,
                                                                num_pairs: int) -> None:
    copy, device, host, host_index, device_index = _copy(layout, num_pairs)
    before = canonical(device, HostLayout.LAYER_FIRST).clone()
    counters = torch.full((5,), 100, dtype=torch.int32)
    copy.launch(1, 4, counters)
    assert copy.items_per_layer == 2 * -(-num_pairs // 4)  # components x tiles
    assert counters.tolist() == [100] + [100 + copy.items_per_layer] * 3 + [100]
    want = expected_after(before, canonical(host, layout), device_index, host_index,
                          slice(1, 4))
    assert torch.equal(canonical(device, HostLayout.LAYER_FIRST), want)
    copy.launch(0, 1)  # uncounted: the counters are never touched
    assert counters.tolist() == [100] + [100 + copy.items_per_layer] * 3 + [100]


@needs_kernel
@pytest.mark.parametrize("counters", [
    torch.zeros(5, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
    torch.zeros(10, dtype=torch.int32)[::2], torch.zeros(1, 5, dtype=torch.int32)],
    ids=["int64", "too_few", "strided", "2d"])
def test_bad_counters_are_refused_before_anything_moves(counters: torch.Tensor) -> None:
    copy, device, *_ = _copy(HostLayout.LAYER_FIRST, 9)
    before, counted = device.clone(), counters.clone()
    with pytest.raises(ValueError, match="counters must be a contiguous 1-D int32 tensor"):
        copy.launch(1, 5, counters)
    assert torch.equal(device, before) and torch.equal(counters, counted)


@needs_kernel
def test_the_counted_and_uncounted_launches_move_the_same_rows() -> None:
    counted, device_a, *_ = _copy(HostLayout.PAGE_FIRST_DIRECT, 30, layers=6)
    plain, device_b, *_ = _copy(HostLayout.PAGE_FIRST_DIRECT, 30, layers=6)
    counted.launch(0, 6, torch.zeros(6, dtype=torch.int32))
    plain.launch(0, 6)
    assert torch.equal(device_a, device_b)


def test_targets_grow_per_launch_and_wrap_like_int32_counters() -> None:
    counters = LayerCounters(4, torch.device("cpu"))
    base = counters.tensor.data_ptr()
    assert counters.issued(range(1, 4), 10) == [(base + 4, 10), (base + 8, 10),
                                               (base + 12, 10)]
    assert counters.issued(range(2, 4), 5) == [(base + 8, 15), (base + 12, 15)]
    counters._issued[3] = 2**32 - 3
    assert counters.issued(range(3, 4), 5) == [(base + 12, 2)]
    assert len(counters) == 4


def test_a_counted_event_answers_the_cpu_through_its_leader() -> None:
    leader, counted = Event(torch.device("cpu")), Event(torch.device("cpu"))
    leader.record()
    counted.count(1234, 7, leader)
    assert counted._counter == (1234, 7) and counted.is_recorded
    assert counted.query() and counted.mark() == leader.mark()
    counted.wait()  # nothing to wait for on a CPU
    counted.record()
    assert counted._counter is None and counted._leader is None
    counted.count(1234, 8, leader)
    counted.follow(leader)
    assert counted._counter is None


def test_nothing_is_counted_without_cuda_or_with_the_call_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    streams = SideStreams(torch.device("cpu"), [])
    assert streams.load_stream is None  # a CPU load keeps its layer groups
    monkeypatch.setattr(layer_counters, "_wait_value", False)
    assert not layer_counters.counters_enabled()
    assert not layer_counters.wait_value(1, 2, 3)
    monkeypatch.setattr(layer_counters, "_wait_value", None)
    monkeypatch.setenv(layer_counters.ENV, "0")
    assert not layer_counters.counters_enabled()


def test_a_refused_wait_turns_counting_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def refuse(*args: object) -> int:
        calls.append(args)
        return 1  # CUDA_ERROR_INVALID_VALUE

    monkeypatch.setattr(layer_counters, "_wait_value", refuse)
    assert layer_counters.counters_enabled()
    assert not layer_counters.wait_value(5, 6, 2**32 + 7)
    assert calls == [(5, 6, 7, 0)]
    assert not layer_counters.counters_enabled()


def test_a_thread_without_a_context_binds_one_and_retries(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    results, bound, calls = [201, 0], [], []

    def call(*args: int) -> int:
        calls.append(args)
        return results.pop(0)

    monkeypatch.setattr(layer_counters, "_wait_value", call)
    monkeypatch.setattr(layer_counters, "_bind_context", lambda: bound.append(True))
    assert layer_counters.wait_value(1, 2, 2**32 + 3)  # the retry waits for the same value
    assert bound == [True] and results == []
    assert calls == [(1, 2, 3, 0), (1, 2, 3, 0)]
    assert layer_counters.counters_enabled()


class _Source:
    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = layers


class _Moved:
    def __init__(self, layers: tuple[int, ...]) -> None:
        self.source = _Source(layers)


class _Op:
    def __init__(self, counts: bool, *parts: tuple[int, ...]) -> None:
        self.executor = type("Backend", (), {"counts_layers": counts})()
        self.moved = [_Moved(layers) for layers in parts]


def test_which_loads_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that counts, pool transfers holding every model layer once between them in
    ascending order (one pool, or a hybrid model's two), three layers or more, a load stream
    and the driver's call: counted, with one set of counters per pool's layers for the
    stream's life; anything else keeps its layer groups."""
    streams = SideStreams(torch.device("cpu"), [])
    # a load stream as on CUDA (the counters go on its device)
    monkeypatch.setattr(streams, "load_stream", SimpleNamespace(device=torch.device("cpu")))
    monkeypatch.setattr("hicache.controller.side_streams.counters_enabled", lambda: True)
    every, even, odd = tuple(range(8)), (0, 2, 4, 6), (1, 3, 5, 7)
    counters = streams._counters(_Op(True, every), 8)  # type: ignore[arg-type]
    assert counters is not None and len(counters[every]) == 8
    one = counters[every]
    assert streams._counters(_Op(True, every), 8)[every] is one  # type: ignore[arg-type,index]
    hybrid = streams._counters(_Op(True, even, odd), 8)  # type: ignore[arg-type]
    assert hybrid is not None and len(hybrid[even]) == len(hybrid[odd]) == 4
    assert hybrid[every] is one  # made once, never replaced
    six = streams._counters(_Op(True, every[:6]), 6)  # type: ignore[arg-type]
    assert six is not None and len(six[every[:6]]) == 6  # a model of another layer count
    for op, layers in [(_Op(False, every), 8),  # the backend does not count (staged, direct)
                       (_Op(True, every, (1, 3)), 8),  # layers 1 and 3 in two pools
                       (_Op(True, even), 8),  # a pool holding some layers, none the rest
                       (_Op(True, (0, 2, 1, 3, 4, 5, 6, 7)), 8),  # a pool's layers unordered
                       (_Op(True, every[:2]), 2)]:  # too few layers to count
        assert streams._counters(op, layers) is None  # type: ignore[arg-type]
    monkeypatch.setattr("hicache.controller.side_streams.counters_enabled", lambda: False)
    assert streams._counters(_Op(True, every), 8) is None  # type: ignore[arg-type]


class _CountingBackend:
    """Records each counted launch (pool layers, local range) and adds ``per_layer`` (0 for
    a pool with nothing to move)."""

    counts_layers = True

    def __init__(self, per_layer: dict[tuple[int, ...], int]) -> None:
        self.per_layer = per_layer
        self.launches: list[tuple[tuple[int, ...], range]] = []

    def copy_counted(self, moved: _Moved, layers: range, counters: torch.Tensor) -> int:
        self.launches.append((moved.source.layers, layers))
        return self.per_layer[moved.source.layers]


def test_a_hybrid_load_counts_each_pool_layers_against_its_own_counters() -> None:
    """Model layers 1..7 of a load over a full pool (0, 2, 3, 6) and an SWA pool (1, 4, 5, 7):
    one launch per pool over its local layers after layer 0; every layer but the last waits
    on its own pool's counter for that launch's count (a second load's targets add to the
    first's), the last layer's event is the load's record; a pool whose launch moves nothing
    gives its layers the counts they had."""
    full, swa = (0, 2, 3, 6), (1, 4, 5, 7)
    counters = {layers: LayerCounters(len(layers), torch.device("cpu")) for layers in (full, swa)}
    groups = (range(0, 1), range(1, 8))
    for round_number, per_layer in enumerate(({full: 3, swa: 5}, {full: 2, swa: 0})):
        backend = _CountingBackend(per_layer)
        op = SimpleNamespace(executor=backend, moved=[_Moved(full), _Moved(swa)])
        parts = [(moved, local_groups(moved.source.layers, groups)) for moved in op.moved]
        events = [Event(torch.device("cpu")) for _ in range(8)]
        SideStreams._issue_counted(op, events, groups[1], parts, counters,  # type: ignore[arg-type]
                                   None)
        assert backend.launches == [(full, range(1, 4)), (swa, range(0, 4))]
        assert events[7]._counter is None and events[7].is_recorded
        assert events[0]._counter is None and not events[0].is_recorded  # group 0's own
        totals = ({full: 3, swa: 5}, {full: 5, swa: 5})[round_number]
        for layer in range(1, 7):
            pool = full if layer in full else swa
            local = pool.index(layer)
            address, value = events[layer]._counter  # type: ignore[misc]
            assert address == counters[pool].tensor.data_ptr() + 4 * local
            assert value == totals[pool], (round_number, layer)
            assert events[layer]._leader is events[7]
