"""Hybrid ops long enough (>= ``BLOCK_MIN_ROWS`` rows a pool) that the torch backend copies
whole runs found from the op's pages: the SWA transfer, the op's second, reads its own
pages, not the full transfer's, in both directions (CPU)."""

from __future__ import annotations

import torch
from controller_helpers import SENTINEL, device_rows, host_rows, make_hybrid

from hicache.controller import TorchBackend
from hicache.controller.base import BLOCK_MIN_ROWS
from hicache.pools import IndexSpace, Indices

TOKENS = 320


def test_a_long_hybrid_write_and_load_move_every_full_and_swa_row() -> None:
    assert TOKENS >= BLOCK_MIN_ROWS
    ctrl = make_hybrid(TorchBackend(), full_pages=200, swa_pages=200, host_pages=200)
    pool = ctrl.hybrid_pool
    # shift the SWA pool's slots away from the full pool's: 6 full tokens whose SWA rows
    # were released, and a host allocation that shifts the full host pool's slots
    ahead = pool.try_alloc(6)
    assert ahead is not None
    pool.free_swa(Indices(ahead.tensor, IndexSpace.DEVICE_FULL))
    spacer = ctrl.host_pool.allocator.try_alloc(8)
    assert spacer is not None
    full = pool.try_alloc(TOKENS)
    assert full is not None
    swa = pool.swa_slots_of(full).tensor
    assert not torch.equal(swa, full.tensor) and bool((swa != 0).all())
    full_rows, swa_rows = device_rows(pool.full)[full.tensor], device_rows(pool.swa)[swa]

    host = ctrl.write(full)
    assert host is not None
    ctrl.drain()
    assert not torch.equal(host.full.tensor, host.swa.tensor)
    assert torch.equal(host_rows(ctrl.host_pool)[host.full.tensor], full_rows)
    assert torch.equal(host_rows(ctrl.host_swa)[host.swa.tensor], swa_rows)

    ctrl.evict_device(full)
    pool.full.data.fill_(SENTINEL)
    pool.swa.data.fill_(SENTINEL)
    back = ctrl.load(host.full, host.swa, swa_tail_tokens=TOKENS)
    assert back is not None
    ctrl.drain()
    assert torch.equal(device_rows(pool.full)[back.full.tensor], full_rows)
    assert bool((back.swa.tensor != 0).all())
    assert torch.equal(device_rows(pool.swa)[back.swa.tensor], swa_rows)
    pool.check_integrity()
