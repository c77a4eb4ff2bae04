"""``wait_until`` skips every wait once its load has finished (the set's last event fired, as
one query per layer asked found), and waits again for the next load recorded into that set
(CPU: the calls it makes; GPU: the rows a forward reads, held-back loads included)."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import (
    check_layer_by_layer,
    gpu_backends,
    make_controller,
    written_and_wiped,
)

from hicache.controller import CacheController, TorchBackend, TransferBackend
from hicache.controller.events import Event, StreamWaits
from hicache.pools import HostLayout, Indices

NUM_LAYERS = 4


class Calls:
    """Counts of the stream waits and of the load-done checks ``wait_until`` makes (the
    checks answer ``done`` when it is not ``None``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, done: bool | None = None) -> None:
        self.waits = self.checks = 0
        wait, load_done = StreamWaits.wait, StreamWaits.load_done

        def counted_wait(waits: StreamWaits, event: Event) -> None:
            self.waits += 1
            wait(waits, event)

        def counted_check(last: Event | None) -> bool:
            self.checks += 1
            return load_done(last) if done is None else done

        monkeypatch.setattr(StreamWaits, "wait", counted_wait)
        monkeypatch.setattr(StreamWaits, "load_done", staticmethod(counted_check))


def loaded(ctrl: CacheController, host: Indices) -> Indices:
    target = ctrl.load(host)
    assert target is not None and ctrl.start_loading() is not None
    return target


def ask_like_a_forward(ctrl: CacheController) -> None:
    """Three asks a layer, as the pool's ``set_kv``, ``key_buffer`` and ``value_buffer``."""
    for layer in range(NUM_LAYERS):
        for _ in range(3):
            ctrl.wait_until(layer)


def test_asks_after_the_load_finished_make_no_stream_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ctrl = make_controller(TorchBackend(), page_size=2, num_layers=NUM_LAYERS)
    host, _ = written_and_wiped(ctrl, 8)
    loaded(ctrl, host)
    calls = Calls(monkeypatch)
    ask_like_a_forward(ctrl)
    assert (calls.checks, calls.waits) == (1, 0)  # one query found it done; no wait after
    ask_like_a_forward(ctrl)  # acknowledged or not, the set's load stays done
    ctrl.poll()
    ask_like_a_forward(ctrl)
    assert (calls.checks, calls.waits) == (1, 0)


def test_while_the_load_runs_each_layer_is_checked_once_and_waited_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ctrl = make_controller(TorchBackend(), page_size=2, num_layers=NUM_LAYERS)
    host, _ = written_and_wiped(ctrl, 8)
    loaded(ctrl, host)
    calls = Calls(monkeypatch, done=False)  # a load that never finishes, as far as asked
    ask_like_a_forward(ctrl)
    assert (calls.checks, calls.waits) == (NUM_LAYERS, 3 * NUM_LAYERS)


def test_a_new_load_into_the_same_set_is_checked_again(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """The ring's sets come round again: a set's new load is a new record of its last event,
    so its first ask checks again instead of trusting the last load's answer."""
    ctrl = make_controller(TorchBackend(), page_size=2, num_layers=NUM_LAYERS)
    host, _ = written_and_wiped(ctrl, 8)
    calls = Calls(monkeypatch)
    sets = []
    for number in range(ctrl.layer_events.num_sets + 1):
        target = loaded(ctrl, host)
        sets.append(ctrl.layer_events.consumer)
        ask_like_a_forward(ctrl)
        assert calls.checks == number + 1 and calls.waits == 0
        assert ctrl.poll()
        ctrl.evict_device(target)
    assert sets[0] == sets[-1]  # the last load went into the first load's set


def test_a_never_loaded_consumer_waits_for_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    ctrl = make_controller(TorchBackend(), page_size=2, num_layers=NUM_LAYERS)
    ctrl.set_consumer(1)
    calls = Calls(monkeypatch)
    ask_like_a_forward(ctrl)
    assert calls.waits == 0
    with pytest.raises(ValueError, match="out of range"):
        ctrl.wait_until(NUM_LAYERS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
def test_held_back_loads_are_waited_on_each_time_their_set_comes_round(
        backend: TransferBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every load of a ring's round, its set reused last, held back on the load stream: a
    forward reading layer by layer sees each load's rows (a set whose earlier load was
    found finished must not skip the waits of its new one), and once a load is done the
    asks make no stream wait."""
    ctrl = make_controller(backend, device="cuda", page_size=4, device_pages=64,
                           host_pages=160, num_layers=NUM_LAYERS,
                           layout=HostLayout.LAYER_FIRST, dtype=torch.bfloat16)
    host, rows = written_and_wiped(ctrl, 32)
    forward = torch.cuda.Stream()
    for _ in range(ctrl.layer_events.num_sets + 1):
        with torch.cuda.stream(ctrl.load_stream):
            torch.cuda._sleep(20_000_000)  # the load starts late
        target = loaded(ctrl, host)
        check_layer_by_layer(ctrl, target, rows, forward)  # synchronises the forward
        ctrl.drain()
        with monkeypatch.context() as patch:
            calls = Calls(patch)
            with torch.cuda.stream(forward):
                ask_like_a_forward(ctrl)
        assert calls.waits == 0
        ctrl.evict_device(target)
