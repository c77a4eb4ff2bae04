"""``start_transfers`` on the hybrid controller: a write of full and SWA rows issued between
the layer groups of a load of both pools, each op as if issued alone (CPU, and the GPU
backends on real streams)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from controller_helpers import (
    SENTINEL,
    BackedUp,
    CallOrder,
    back_up_and_evict,
    device_rows,
    fill_unique,
    host_rows,
    make_hybrid,
    on_each_gpu_backend_and_layout,
    start_together,
)

from hicache.controller import (
    Direction,
    HybridCacheController,
    HybridSlots,
    TransferBackend,
    side_streams,
)
from hicache.controller.load_groups import LINK_BYTES_PER_S
from hicache.pools import HostLayout, Indices

D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE
NUM_LAYERS = 8
SWA_LAYERS = (1, 3, 5, 7)
TAIL = 4  # tokens of the loaded sequence with SWA rows (its window)


class Queued(NamedTuple):
    """Both directions queued: the backed-up sequence and its load's device slots, the
    written sequence and its host copies."""

    backed: BackedUp
    back: HybridSlots
    written: Indices
    backup: HybridSlots


def queue_both(ctrl: HybridCacheController, num_tokens: int) -> Queued:
    """A sequence of ``num_tokens`` backed up and evicted (SWA rows on its last
    :data:`TAIL` tokens), its load queued, and a write queued of as many fresh device rows
    (SWA rows on all of them)."""
    backed = back_up_and_evict(ctrl, num_tokens, no_swa_tokens=num_tokens - TAIL)
    pool = ctrl.hybrid_pool
    fill_unique(pool.full.data, offset=0.25)
    fill_unique(pool.swa.data, offset=0.75)
    written = pool.try_alloc(num_tokens)
    assert written is not None
    backup = ctrl.write(written)
    back = ctrl.load(backed.host.full, backed.host.swa, swa_tail_tokens=TAIL)
    assert backup is not None and back is not None
    return Queued(backed, back, written, backup)


def check_rows(ctrl: HybridCacheController, queued: Queued) -> None:
    """The load brought the backed-up full rows and SWA tail; the write's host rows are the
    written device rows, full and SWA."""
    pool, backed, back = ctrl.hybrid_pool, queued.backed, queued.back
    assert torch.equal(device_rows(pool.full)[back.full.tensor.cpu()], backed.full_rows)
    tail = (back.swa.tensor != 0).cpu()
    assert tail.tolist() == [False] * (len(back.full) - TAIL) + [True] * TAIL
    assert torch.equal(device_rows(pool.swa)[back.swa.tensor.cpu()[tail]],
                       backed.swa_rows[backed.swa_before[tail]])
    written_swa = pool.swa_slots_of(queued.written).tensor.cpu()
    assert torch.equal(host_rows(ctrl.host_pool)[queued.backup.full.tensor.cpu()],
                       device_rows(pool.full)[queued.written.tensor.cpu()])
    assert torch.equal(host_rows(ctrl.host_swa)[queued.backup.swa.tensor.cpu()],
                       device_rows(pool.swa)[written_swa])


@pytest.mark.parametrize("cover_layers", [0, 2, 5, NUM_LAYERS + 1])
def test_hybrid_write_goes_between_the_load_groups_of_both_pools(
        monkeypatch: pytest.MonkeyPatch, cover_layers: int) -> None:
    """The write (one copy per pool) goes after the load groups whose bytes cover its issue
    (``cover_layers`` layers' worth; groups of one layer here): after group 0 at least,
    after the whole load when its bytes do not cover it, never a group more than needed;
    every model layer is loaded once, from its pool."""
    backend = CallOrder()
    ctrl = make_hybrid(backend, num_layers=NUM_LAYERS, swa_layers=SWA_LAYERS, full_pages=32,
                       swa_pages=24, host_pages=64)
    queued = queue_both(ctrl, 8)
    half = NUM_LAYERS - len(SWA_LAYERS)  # layers of each pool
    token_bytes = ctrl.hybrid_pool.full.geometry.token_bytes(half)
    layer_bytes = (8 + TAIL) * token_bytes // NUM_LAYERS  # the load's, as its issue counts
    monkeypatch.setattr(side_streams, "plan_load_groups",
                        lambda num_layers, *_: tuple(range(n, n + 1) for n in range(num_layers)))
    at = start_together(ctrl, backend.calls, monkeypatch,
                        cover_layers * layer_bytes / LINK_BYTES_PER_S)
    directions = [direction for direction, _ in backend.calls]
    writes = backend.calls[at:at + 2]
    assert directions.count(D2H) == 2 and [d for d, _ in writes] == [D2H, D2H]
    assert sorted(layer for _, layers in writes for layer in layers) == list(range(NUM_LAYERS))
    loaded = [layer for direction, layers in backend.calls if direction is H2D
              for layer in layers]
    before = sorted(layer for _, layers in backend.calls[:at] for layer in layers)
    assert sorted(loaded) == list(range(NUM_LAYERS)) and at >= 1
    # one layer a group: the split's place shows, group by group
    assert before == list(range(min(max(cover_layers, 1), NUM_LAYERS)))
    acks = ctrl.poll()
    assert sorted(ack.direction.value for ack in acks) == sorted([D2H.value, H2D.value])
    by_direction = {ack.direction: ack.tokens_by_pool for ack in acks}
    assert by_direction[H2D] == {"full": 8, "swa": TAIL}
    assert by_direction[D2H] == {"full": 8, "swa": 8}
    check_rows(ctrl, queued)
    ctrl.hybrid_pool.check_integrity()
    assert ctrl.num_in_flight == 0


@on_each_gpu_backend_and_layout
def test_hybrid_together_on_gpu_each_layer_waits_for_its_rows(backend: TransferBackend,
                                                              layout: HostLayout) -> None:
    """Issued together on real streams (the load stream held back at first), a forward
    that waits per layer reads each layer's loaded rows from its pool (full rows, the SWA
    tail), and the write's host rows are the device's."""
    ctrl = make_hybrid(backend, device="cuda", layout=layout, page_size=4,
                       num_layers=NUM_LAYERS, swa_layers=SWA_LAYERS, full_pages=64,
                       swa_pages=48, host_pages=128)
    queued = queue_both(ctrl, 64)
    pool, backed, back = ctrl.hybrid_pool, queued.backed, queued.back
    tail = back.swa.tensor != 0
    full_index, swa_index = back.full.tensor.cuda(), back.swa.tensor.cuda()[tail.cuda()]
    with torch.cuda.stream(ctrl.load_stream):
        torch.cuda._sleep(20_000_000)  # the load starts late
    assert ctrl.start_transfers() is not None
    forward, seen = torch.cuda.Stream(), []
    with torch.cuda.stream(forward):
        for layer in range(NUM_LAYERS):
            ctrl.wait_until(layer)
            is_swa, local = pool.layer_mapping[layer]
            data, index = (pool.swa.data, swa_index) if is_swa else (pool.full.data, full_index)
            seen.append(data[:, local, index].clone())
    forward.synchronize()
    for layer, got in enumerate(seen):
        is_swa, local = pool.layer_mapping[layer]
        want = (backed.swa_rows[backed.swa_before[tail.cpu()]] if is_swa
                else backed.full_rows)[:, :, local]
        assert not (got == SENTINEL).any(), layer
        assert torch.equal(got.permute(1, 0, 2).cpu(), want), layer
    ctrl.drain()
    check_rows(ctrl, queued)
    pool.check_integrity()
    assert ctrl.num_in_flight == 0
