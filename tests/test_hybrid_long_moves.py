"""Ops long enough (>= ``BLOCK_MIN_ROWS`` rows a pool) that the torch backend copies whole
runs: found from a hybrid op's pages (the SWA transfer, the op's second, reads its own
pages, not the full transfer's), or from the slots of a move without pages, in both
directions (CPU)."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import SENTINEL, device_rows, host_rows, make_controller, make_hybrid

from hicache.controller import TorchBackend
from hicache.controller.base import BLOCK_MIN_ROWS, Direction, MovedTransfer, PoolTransfer
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


@pytest.mark.parametrize("shape", ["run", "shifted_run", "scattered", "run_out_of_order"])
@pytest.mark.parametrize("direction", [Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE])
def test_a_long_move_without_its_pages_finds_runs_from_the_slots(shape: str,
                                                                  direction: Direction
                                                                  ) -> None:
    """A move of BLOCK_MIN_ROWS pairs or more that carries no page ids (a backend called
    with slots alone): slots that are one ascending run are copied as one block, any
    others row by row; either way exactly the pairs' rows move, nothing else."""
    ctrl = make_controller(TorchBackend(), device_pages=400, host_pages=400)
    count = BLOCK_MIN_ROWS + 7
    gen = torch.Generator().manual_seed(count)
    host = {"run": torch.arange(1, 1 + count), "shifted_run": torch.arange(40, 40 + count),
            "scattered": torch.randperm(399, generator=gen)[:count] + 1,
            "run_out_of_order": torch.arange(40, 40 + count).roll(1)}[shape]
    device = torch.arange(100, 100 + count)
    ctrl.host_pool.data.copy_(torch.randn(ctrl.host_pool.data.shape, generator=gen))
    host_before, device_before = host_rows(ctrl.host_pool), device_rows(ctrl.device_pool)
    transfer = PoolTransfer(
        name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
        host_indices=Indices(host, IndexSpace.HOST_FULL),
        device_indices=Indices(device, IndexSpace.DEVICE_FULL),
        layers=tuple(range(ctrl.device_pool.num_layers)))
    moved = MovedTransfer(transfer, host, device)
    assert moved.pages is None
    TorchBackend().copy(moved, list(range(ctrl.device_pool.num_layers)), direction, [])
    if direction is Direction.DEVICE_TO_HOST:
        expected = host_before.clone()
        expected[host] = device_before[device]
        assert torch.equal(host_rows(ctrl.host_pool), expected)
    else:
        expected = device_before.clone()
        expected[device] = host_before[host]
        assert torch.equal(device_rows(ctrl.device_pool), expected)
