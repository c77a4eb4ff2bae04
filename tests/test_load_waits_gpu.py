"""A load lands after the work the streams it must wait for queued before it: a producer
stream's (the engine's forward) and the stream that was current where it was started. The
forward may still write the reused slots a load targets (here: a fill behind a sleep); the
load's rows must be what remains. On a real GPU, every backend and host layout, one layer
group and several, and with every copy taking turns on the copy streams (``staged``
scatters whole pages there and ``direct`` copies big blocks there: they must wait too)."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import device_rows, gpu_backends, make_controller, written_and_wiped

from hicache.controller import TransferBackend, copy_turns, load_groups
from hicache.pools import HostLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLEEP_CYCLES = 20_000_000  # ~10 ms on a current GPU
STALE = 9.0


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("layer_wise", [False, True], ids=["one_group", "per_layer"])
@pytest.mark.parametrize("busy", ["producer", "caller"])
@pytest.mark.parametrize("turns", [False, True], ids=["", "turns"])
def test_a_load_lands_after_the_streams_it_waits_for(
        backend: TransferBackend, layout: HostLayout, layer_wise: bool, busy: str, turns: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if turns:  # every copy a big one: the next waits for it, on the other copy stream
        monkeypatch.setattr(copy_turns, "TURN_BYTES", 1)
    if layer_wise:  # a group per layer
        monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1.0)
        monkeypatch.setattr(load_groups, "GROUP_BYTES", 1)
        monkeypatch.setattr(load_groups, "MAX_COPIES", 64)
    ctrl = make_controller(backend, device="cuda", page_size=4, device_pages=40, host_pages=80,
                           num_layers=4, layout=layout, dtype=torch.bfloat16)
    host, rows = written_and_wiped(ctrl, 64)
    loaded = ctrl.load(host)
    assert loaded is not None
    index = loaded.tensor.cuda()
    stream = torch.cuda.Stream()
    if busy == "producer":
        ctrl.register_producer_stream(stream)
    stream.wait_stream(torch.cuda.current_stream())  # the index copy above
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        ctrl.device_pool.data.index_fill_(2, index, STALE)  # not an indexed assignment: it
        if busy == "caller":  # would block the CPU until the sleep is over
            ctrl.start_loading()
    if busy == "producer":
        ctrl.start_loading()
    ctrl.drain()
    assert torch.equal(device_rows(ctrl.device_pool)[loaded.tensor], rows)
