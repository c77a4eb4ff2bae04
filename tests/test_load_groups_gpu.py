"""Grouped layer-wise loads on a real GPU: every layer's event orders a reader on another
stream after that layer's rows, and the rows arrive bit for bit (kernel and staged backends,
every host layout, full and hybrid pools). Run under compute-sanitizer by
``scripts/gpu_check.sh`` at small shapes."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import (
    SENTINEL,
    back_up_and_evict,
    device_rows,
    make_controller,
    make_hybrid,
    untouched,
)
from gpu_shapes import scaled

from hicache.controller import (
    CacheController,
    HybridCacheController,
    KernelBackend,
    TransferBackend,
    TransferCore,
    layer_counters,
    load_groups,
)
from hicache.controller.direct import DirectBackend
from hicache.controller.kernel import kernel_available
from hicache.controller.staged import StagedBackend
from hicache.pools import DeviceKVPool, HostLayout, Indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLEEP_CYCLES = 20_000_000  # ~10 ms on a current GPU: holds the load back behind a producer
NUM_LAYERS = 32
NUM_TOKENS = scaled(1024, 96)
HYBRID_SWA_LAYERS = (1, 3, 4, 5, 6, 10, 13)


def gpu_backends() -> list[TransferBackend]:
    """Staged with chunks smaller than a group (several chunks per copy), and the kernel."""
    found: list[TransferBackend] = [StagedBackend(staging_tokens=16), DirectBackend()]
    if kernel_available():
        found.append(KernelBackend(num_programs=16))
    return found


def read_layer_by_layer(ctrl: TransferCore,
                        reads: list[tuple[DeviceKVPool, int, torch.Tensor]]) -> list[torch.Tensor]:
    """On a fresh stream, for each model layer in turn, wait for it and copy its rows as an
    engine's forward reads them: ``reads[layer]`` is (the pool holding it, its local layer
    there, CPU slots). Returns ``[components, n, row]`` per model layer."""
    indices = [slots.cuda() for _, _, slots in reads]
    forward = torch.cuda.Stream()
    forward.wait_stream(torch.cuda.current_stream())  # the index copies were issued there
    seen = []
    with torch.cuda.stream(forward):
        for layer, ((pool, local, _), index) in enumerate(zip(reads, indices, strict=True)):
            ctrl.wait_until(layer)
            seen.append(pool.data[:, local].index_select(1, index))
    forward.synchronize()
    return seen


def start_held_load(ctrl: CacheController, host: Indices) -> Indices:
    """Wipe the device pool, hold the load stream behind a sleeping producer and start the
    load of ``host``; its device slots."""
    ctrl.device_pool.data.fill_(SENTINEL)
    torch.cuda.synchronize()
    held_back(ctrl)
    loaded = ctrl.load(host)
    assert loaded is not None
    ctrl.start_loading()
    return loaded


def check_layers(seen: list[torch.Tensor], rows: torch.Tensor) -> None:
    """Each layer read (``[components, n, row]``) equals that layer of ``rows``
    (``[n, components, layers, row]``)."""
    for layer, got in enumerate(seen):
        assert torch.equal(got.cpu(), rows[:, :, layer].permute(1, 0, 2)), f"layer {layer}"


def held_back(ctrl: TransferCore) -> None:
    """Keep the load stream busy behind a sleeping producer, so a reader that does not wait
    for a layer's event reads the sentinel."""
    producer = torch.cuda.Stream()
    ctrl.register_producer_stream(producer)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP_CYCLES)


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("grouping", ["grouped", "copy_bound", "per_layer"])
def test_grouped_load_events_and_rows(backend: TransferBackend, layout: HostLayout,
                                      grouping: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 32-layer load modelled as bound by the link (groups of 1, 3, 6, 12, 10 layers; of
    the copy-count bound's 3 layers, as big ops; or one per layer): a reader waiting on each
    layer's event sees exactly that layer's rows; afterwards every loaded row is bit-exact
    and every other row keeps the sentinel."""
    monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1.0)
    if grouping != "grouped":
        monkeypatch.setattr(load_groups, "GROUP_BYTES", 1)
    if grouping == "per_layer":
        monkeypatch.setattr(load_groups, "MAX_COPIES", NUM_LAYERS)
    ctrl: CacheController = make_controller(
        backend, device="cuda", page_size=4, device_pages=NUM_TOKENS // 4 + 8,
        host_pages=NUM_TOKENS // 4 + 8, num_layers=NUM_LAYERS, layout=layout,
        dtype=torch.bfloat16)
    pool = ctrl.device_pool
    pool.data.copy_(torch.randn(pool.data.shape, device="cuda").to(torch.bfloat16))
    assert ctrl.device_allocator.try_alloc(8) is not None  # device and host slot ids differ
    device = ctrl.device_allocator.try_alloc(NUM_TOKENS)
    assert device is not None
    rows = device_rows(pool)[device.tensor]
    host = ctrl.write(device)
    assert host is not None
    ctrl.drain()
    ctrl.evict_device(device)
    loaded = start_held_load(ctrl, host)
    seen = read_layer_by_layer(ctrl, [(pool, layer, loaded.tensor)
                                      for layer in range(NUM_LAYERS)])
    ctrl.drain()
    check_layers(seen, rows)
    after = device_rows(pool)
    assert torch.equal(after[loaded.tensor], rows)
    assert (untouched(after, loaded.tensor) == SENTINEL).all()


@pytest.mark.parametrize("backend", gpu_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("swa_tail", [8, 0], ids=["tail", "no_tail"])
def test_hybrid_grouped_load(backend: TransferBackend, layout: HostLayout,
                             swa_tail: int) -> None:
    """16 layers with SWA layers spread over them, in layer groups (staged, direct) or, on
    the kernel, layer 0 and then one counted launch per pool: a reader waiting on each
    layer sees its full rows (every token) and SWA rows (the tail). With no SWA tail the
    SWA pool's launch moves nothing and its layers are ready at once."""
    ctrl = make_hybrid(backend, device="cuda", layout=layout, num_layers=16,
                       swa_layers=HYBRID_SWA_LAYERS, full_pages=24, swa_pages=16,
                       host_pages=48)
    counted = load_and_read_hybrid(ctrl, HYBRID_SWA_LAYERS, 16, swa_tail)
    if backend.counts_layers and layer_counters.counters_enabled():
        assert counted == [False] + [True] * 14 + [False]
    else:
        assert not any(counted)


def load_and_read_hybrid(ctrl: HybridCacheController, swa_layers: tuple[int, ...],
                         num_layers: int, swa_tail: int) -> list[bool]:
    """On a fresh hybrid controller: back up and evict 20 tokens (the first 12 without SWA
    rows), load them back with ``swa_tail`` tokens of SWA rows behind a sleeping producer,
    read every layer as it becomes ready and check its full or SWA rows, then every row of
    both pools. Returns, per model layer, whether its event waits on a counter."""
    pool = ctrl.hybrid_pool
    _, host, swa_before, full_rows, swa_rows = back_up_and_evict(ctrl, 20, no_swa_tokens=12)
    torch.cuda.synchronize()
    held_back(ctrl)
    back = ctrl.load(host.full, host.swa, swa_tail_tokens=swa_tail)
    assert back is not None
    ctrl.start_loading()
    ring = ctrl.layer_events
    assert ring.consumer is not None
    counted = [event._counter is not None for event in ring._sets[ring.consumer]]
    tail = back.swa.tensor != 0
    full_layers = [layer for layer in range(num_layers) if layer not in swa_layers]
    reads = [(pool.swa, swa_layers.index(layer), back.swa.tensor[tail])
             if layer in swa_layers else (pool.full, full_layers.index(layer), back.full.tensor)
             for layer in range(num_layers)]
    seen = read_layer_by_layer(ctrl, reads)
    ctrl.drain()
    for layer, ((data, local, _), got) in enumerate(zip(reads, seen, strict=True)):
        want = (swa_rows[swa_before[tail]] if data is pool.swa else full_rows)[:, :, local]
        assert torch.equal(got.cpu(), want.permute(1, 0, 2)), f"layer {layer}"
    after_full, after_swa = device_rows(pool.full), device_rows(pool.swa)
    assert torch.equal(after_full[back.full.tensor], full_rows)
    assert (untouched(after_full, back.full.tensor) == SENTINEL).all()
    assert (untouched(after_swa, back.swa.tensor[tail]) == SENTINEL).all()
    return counted
