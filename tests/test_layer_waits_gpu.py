"""Each layer's event of a grouped layer-wise load means that layer, whichever layer a
reader waits for first: a layer in the middle of a group is ready only once its group's
copy is done, not merely once the layers before it are (an engine's forward waits in
order, which would hide a layer left without its own event; a reader may not). On a real
GPU, the load held behind a sleeping producer, every backend that groups layers."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import make_controller, written_and_wiped
from test_load_groups_gpu import NUM_LAYERS, NUM_TOKENS, gpu_backends, start_held_load

from hicache.controller import CacheController, TransferBackend, load_groups

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("grouping", ["grouped", "copy_bound"])
def test_a_reader_waiting_for_one_layer_first_sees_that_layers_rows(
        backend: TransferBackend, grouping: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1.0)  # groups of several layers
    if grouping == "copy_bound":
        monkeypatch.setattr(load_groups, "GROUP_BYTES", 1)
    ctrl: CacheController = make_controller(
        backend, device="cuda", page_size=4, device_pages=NUM_TOKENS // 4 + 8,
        host_pages=NUM_TOKENS // 4 + 8, num_layers=NUM_LAYERS, dtype=torch.bfloat16)
    host, rows = written_and_wiped(ctrl, NUM_TOKENS)
    pool = ctrl.device_pool
    for layer in range(NUM_LAYERS):
        loaded = start_held_load(ctrl, host)
        index = loaded.tensor.cuda()
        reader = torch.cuda.Stream()
        reader.wait_stream(torch.cuda.current_stream())  # the index copy above
        with torch.cuda.stream(reader):
            ctrl.wait_until(layer)  # no wait for the layers before it
            seen = pool.data[:, layer].index_select(1, index)
        reader.synchronize()
        ctrl.drain()
        want = rows[:, :, layer].permute(1, 0, 2)
        assert torch.equal(seen.cpu(), want), f"layer {layer} read before its rows arrived"
        ctrl.evict_device(loaded)
