"""Counted layer-wise loads on a real GPU (``kernel`` backend): layer 0 in its own launch,
the other layers in one launch whose counters make each layer ready on its own. A reader on
another stream that waits for each layer in turn (``wait_until``) sees exactly that layer's
rows while the load is held behind a sleeping producer, so a wait that let it through early
would read the sentinel; the same holds across the counters' int32 wraparound, for two
loads queued back to back, with counting turned off (layer groups), and when the driver
refuses a wait (the reader then waits for the whole load). Whether a held-back load is still
in flight when the reader comes depends on the host's speed (under compute-sanitizer it may
be done); the tests of the driver calls force that case. Run under compute-sanitizer by
``scripts/gpu_check.sh`` at small shapes."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import (
    SENTINEL,
    device_rows,
    make_controller,
    make_hybrid,
    untouched,
    written_and_wiped,
)
from gpu_shapes import scaled
from test_load_groups_gpu import (
    check_layers,
    load_and_read_hybrid,
    read_layer_by_layer,
    start_held_load,
)

from hicache.controller import CacheController, KernelBackend, layer_counters
from hicache.controller.events import StreamWaits
from hicache.controller.kernel import kernel_available
from hicache.pools import HostLayout, Indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(torch.cuda.is_available() and not kernel_available(),
                       reason="needs Triton"),
]

NUM_LAYERS = 32
NUM_TOKENS = scaled(1024, 96)


def _controller(layout: HostLayout) -> CacheController:
    ctrl = make_controller(
        KernelBackend(num_programs=16), device="cuda", page_size=4,
        device_pages=2 * NUM_TOKENS // 4 + 24, host_pages=2 * NUM_TOKENS // 4 + 24,
        num_layers=NUM_LAYERS, layout=layout, dtype=torch.bfloat16)
    pool = ctrl.device_pool
    pool.data.copy_(torch.randn(pool.data.shape, device="cuda").to(torch.bfloat16))
    assert ctrl.device_allocator.try_alloc(8) is not None  # device and host slot ids differ
    return ctrl


def _load_and_read(ctrl: CacheController, host: Indices, rows: torch.Tensor) -> Indices:
    """Load ``host`` behind a sleeping producer, read it layer by layer as it becomes
    ready, and check every layer's rows and that nothing else was written."""
    pool = ctrl.device_pool
    loaded = start_held_load(ctrl, host)
    check_layers(_read(ctrl, loaded), rows)
    ctrl.drain()
    after = device_rows(pool)
    assert torch.equal(after[loaded.tensor], rows)
    assert (untouched(after, loaded.tensor) == SENTINEL).all()
    return loaded


def _read(ctrl: CacheController, slots: Indices) -> list[torch.Tensor]:
    """Every layer's rows at ``slots``, each read once its layer is ready."""
    return read_layer_by_layer(ctrl, [(ctrl.device_pool, layer, slots.tensor)
                                      for layer in range(NUM_LAYERS)])


def _counted(ctrl: CacheController) -> list[bool]:
    """Per layer of the consumer set: whether its event waits on a counter."""
    ring = ctrl.layer_events
    assert ring.consumer is not None
    return [event._counter is not None for event in ring._sets[ring.consumer]]


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_each_layer_of_a_counted_load_is_ready_on_its_own(layout: HostLayout) -> None:
    assert layer_counters.counters_enabled(), "this GPU's driver lacks the wait on a value"
    ctrl = _controller(layout)
    host, rows = written_and_wiped(ctrl, NUM_TOKENS)
    _load_and_read(ctrl, host, rows)
    assert _counted(ctrl) == [False] + [True] * (NUM_LAYERS - 2) + [False]


def test_counters_across_their_int32_wraparound() -> None:
    ctrl = _controller(HostLayout.LAYER_FIRST)
    host, rows = written_and_wiped(ctrl, NUM_TOKENS)
    _load_and_read(ctrl, host, rows)  # makes the load stream's counters
    counters = ctrl._streams._layer_counters[tuple(range(NUM_LAYERS))]
    counters.tensor.fill_(-3)  # 2**32 - 3: the next load's targets pass 0
    counters._issued = [2**32 - 3] * NUM_LAYERS
    _load_and_read(ctrl, host, rows)
    torch.cuda.synchronize()
    assert all(0 < value < 2**20 for value in counters.tensor.tolist()[1:])


def test_two_counted_loads_queued_back_to_back() -> None:
    """The second load's targets include the first's counts: its reader, held back behind
    both, must not pass on the first load's rows."""
    ctrl = _controller(HostLayout.PAGE_FIRST_DIRECT)
    first_host, _ = written_and_wiped(ctrl, NUM_TOKENS)
    second_host, rows = written_and_wiped(ctrl, NUM_TOKENS)
    start_held_load(ctrl, first_host)
    second = ctrl.load(second_host)
    assert second is not None
    ctrl.start_loading()
    check_layers(_read(ctrl, second), rows)
    ctrl.drain()


@pytest.mark.parametrize("off_by", ["environment", "no_driver_call"])
def test_with_counters_off_a_kernel_load_keeps_its_layer_groups(
        off_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting off, by the operator's switch (``HICACHE_LAYER_COUNTERS=0``, read when the
    driver's call is first looked up) or with no driver call: a load keeps its groups."""
    if off_by == "environment":
        monkeypatch.setattr(layer_counters, "_wait_value", None)  # looked up again
        monkeypatch.setenv(layer_counters.ENV, "1")
        assert layer_counters.counters_enabled()  # this GPU's driver has the call
        monkeypatch.setattr(layer_counters, "_wait_value", None)
        monkeypatch.setenv(layer_counters.ENV, "0")
        assert not layer_counters.counters_enabled()
    else:
        monkeypatch.setattr(layer_counters, "_wait_value", False)
    ctrl = _controller(HostLayout.LAYER_FIRST)
    host, rows = written_and_wiped(ctrl, NUM_TOKENS)
    _load_and_read(ctrl, host, rows)
    assert not any(_counted(ctrl))
    assert ctrl._streams._layer_counters == {}


def test_a_refused_wait_waits_for_the_whole_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver refuses the reader's waits (each made as for a load in flight, however
    fast this one ran): each waits on the load's last event instead (later, still
    correct), and loads after it keep their layer groups."""
    ctrl = _controller(HostLayout.LAYER_FIRST)
    host, rows = written_and_wiped(ctrl, NUM_TOKENS)
    loaded = start_held_load(ctrl, host)
    assert _counted(ctrl)[1]
    monkeypatch.setattr(StreamWaits, "load_done", staticmethod(lambda last: False))
    monkeypatch.setattr(layer_counters, "_wait_value", lambda *args: 1)
    seen = _read(ctrl, loaded)
    assert not layer_counters.counters_enabled()
    check_layers(seen, rows)
    ctrl.drain()
    _load_and_read(ctrl, host, rows)
    assert not any(_counted(ctrl))


@pytest.mark.parametrize("in_flight", [True, False], ids=["in_flight", "done"])
def test_waits_skip_the_driver_once_the_load_has_fired(in_flight: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait on a counted layer calls the driver while its load is in flight (forced here:
    whether a held-back load is still running when the reader comes depends on the host's
    speed) and not once the load's last event has fired."""
    assert layer_counters.counters_enabled()
    real, calls = layer_counters._wait_value, []

    def counting(*args: object) -> int:
        calls.append(args)
        return int(real(*args))

    monkeypatch.setattr(layer_counters, "_wait_value", counting)
    if in_flight:
        monkeypatch.setattr(StreamWaits, "load_done", staticmethod(lambda last: False))
    ctrl = _controller(HostLayout.LAYER_FIRST)
    host, rows = written_and_wiped(ctrl, NUM_TOKENS)
    loaded = _load_and_read(ctrl, host, rows)
    assert _counted(ctrl)[1:-1] == [True] * (NUM_LAYERS - 2)
    calls.clear()
    seen = _read(ctrl, loaded)  # the load is done
    assert len(calls) == (NUM_LAYERS - 2 if in_flight else 0)
    check_layers(seen, rows)


@pytest.mark.parametrize("swa_layers", [(0, 2, 5, 7), (1, 2, 3, 4, 5, 6, 7)],
                         ids=["layer_0_swa", "full_holds_layer_0_only"])
def test_a_hybrid_load_is_counted_per_pool(swa_layers: tuple[int, ...]) -> None:
    """A hybrid model's load: layer 0 alone (here an SWA layer, or the full pool's only
    one), then one counted launch per pool that has layers left; a reader waiting on each
    layer while the load is held back sees exactly that layer's full or SWA rows."""
    num_layers = 8
    ctrl = make_hybrid(KernelBackend(num_programs=16), device="cuda",
                       layout=HostLayout.LAYER_FIRST, num_layers=num_layers,
                       swa_layers=swa_layers, full_pages=24, swa_pages=16, host_pages=48)
    assert load_and_read_hybrid(ctrl, swa_layers, num_layers, 8) == (
        [False] + [True] * (num_layers - 2) + [False])
