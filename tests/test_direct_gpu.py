"""The direct backend on a GPU: bit for bit against the torch backend for scattered pairs
(every layout, MHA and MLA, with 2D copies and with the row-by-row fallback), a long run's
layer-wise load read layer by layer on another stream while a write of another run is in
flight (both directions at once), and auto's choice of it for a fresh allocation."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import SENTINEL, device_rows, host_rows, make_controller
from test_staged import fragmented_round_trip

from hicache.controller import TorchBackend, copy2d, make_backend
from hicache.controller.direct import DIRECT_MIN_RUN_TOKENS, DirectBackend
from hicache.pools import AttentionKind, HostLayout, IndexSpace, Indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda x: x.value)
@pytest.mark.parametrize("two_d", [True, False], ids=["2d", "row-by-row"])
def test_direct_equals_torch(layout: HostLayout, kind: AttentionKind, two_d: bool,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    if two_d:
        assert copy2d.have_2d_copies(), "no CUDA runtime library found for 2D copies"
    else:
        monkeypatch.setattr(copy2d, "_cudart", lambda: None)
    expected = fragmented_round_trip(TorchBackend(), layout, kind, "cuda")
    found = fragmented_round_trip(DirectBackend(), layout, kind, "cuda")
    assert torch.equal(found[0], expected[0])
    assert torch.equal(found[1], expected[1])


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_layer_wise_load_beside_a_write(layout: HostLayout) -> None:
    """A run of 8 pages is loaded layer by layer while another run is written back: each
    layer read after ``wait_until`` on a fresh stream holds the loaded rows, the write's
    host rows equal its device rows, and nothing else changed."""
    ctrl = make_controller(make_backend("auto", torch.device("cuda")), device="cuda",
                           page_size=16, device_pages=64, host_pages=64, num_layers=6,
                           layout=layout, dtype=torch.bfloat16)
    first = ctrl.device_allocator.try_alloc(128)
    second = ctrl.device_allocator.try_alloc(128)
    assert first is not None and second is not None
    expected = device_rows(ctrl.device_pool).clone()
    host = ctrl.write(first)
    assert host is not None
    ctrl.drain()
    ctrl.evict_device(first)
    ctrl.device_pool.data[:, :, first.tensor.cuda()] = SENTINEL
    loaded = ctrl.load(host)
    written = ctrl.write(second)
    assert loaded is not None and written is not None
    ctrl.start_writing()
    ctrl.start_loading()
    reader = torch.cuda.Stream()
    layers = []
    with torch.cuda.stream(reader):
        for layer in range(6):
            ctrl.wait_until(layer)
            layers.append(ctrl.device_pool.data[:, layer, loaded.tensor.cuda()].clone())
    reader.synchronize()
    ctrl.drain()
    for layer, rows in enumerate(layers):
        assert torch.equal(rows.cpu(), expected[first.tensor][:, :, layer].transpose(0, 1))
    assert torch.equal(host_rows(ctrl.host_pool)[written.tensor], expected[second.tensor])


def test_auto_moves_a_fresh_allocation_directly() -> None:
    """auto on a layer_first host: a long fresh allocation's write and load run on direct;
    a scattered one of the same size follows the measured table."""
    ctrl = make_controller(make_backend("auto", torch.device("cuda")), device="cuda",
                           page_size=16, device_pages=128, host_pages=128, num_layers=4)
    run = ctrl.device_allocator.try_alloc(2 * DIRECT_MIN_RUN_TOKENS)
    assert run is not None
    ctrl.write(run)
    ctrl.drain()
    pages = torch.randperm(run.tensor.numel() // 16, generator=torch.Generator().manual_seed(0))
    scattered = Indices(run.tensor.view(-1, 16)[pages].flatten(), IndexSpace.DEVICE_FULL)
    ctrl.write(scattered)
    ctrl.drain()
    backends = [backend for (_, backend) in ctrl.stats.backend_ops]
    assert backends[0] == "direct" and backends[1] != "direct"
