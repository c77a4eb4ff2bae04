"""The direct backend (copy-engine copies per run of slots) on CPU pools: the same rows as the
torch backend for every layout, runs and scattered pairs, layer groups; its plans; auto's
choice of it."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from controller_helpers import (
    SENTINEL,
    device_rows,
    fill_unique,
    host_rows,
    make_controller,
    untouched,
)
from test_controller import round_trip
from test_staged import fragmented_round_trip, issued_copies

from hicache.controller import Direction, TorchBackend, copy2d, make_backend
from hicache.controller.auto import AutoBackend, AutoRow
from hicache.controller.base import MovedTransfer, PoolTransfer
from hicache.controller.direct import (
    DIRECT_MIN_RUN_TOKENS,
    DirectBackend,
    count_runs,
    pair_runs,
    worth_direct,
)
from hicache.controller.staged import StagedBackend
from hicache.pools import AttentionKind, HostLayout, IndexSpace, Indices

LAYOUTS = list(HostLayout)
D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE


def test_pair_runs_break_where_either_side_jumps() -> None:
    host = np.array([4, 5, 6, 9, 10, 11, 3])
    device = np.array([20, 21, 30, 31, 32, 33, 34])
    firsts_host, firsts_device, lengths = pair_runs(host, device)
    assert firsts_host.tolist() == [4, 6, 9, 3]
    assert firsts_device.tolist() == [20, 30, 31, 34]
    assert lengths.tolist() == [2, 1, 3, 1]
    assert count_runs(host, device) == 4
    assert [a.tolist() for a in pair_runs(np.zeros(0), np.zeros(0))] == [[], [], []]
    assert count_runs(np.zeros(0), np.zeros(0)) == 0


def test_worth_direct_needs_long_runs() -> None:
    n = DIRECT_MIN_RUN_TOKENS
    run = np.arange(1, 2 * n + 1)
    assert worth_direct(run, run + 7)
    halves = np.concatenate([np.arange(1, n + 1), np.arange(3 * n, 4 * n)])
    assert worth_direct(halves, run)  # two runs of n each
    assert not worth_direct(halves[:-1], run[:-1])  # one of them a token short
    assert not worth_direct(np.zeros(0), np.zeros(0))
    pages = np.random.default_rng(0).permutation(64)
    assert not worth_direct((pages[:, None] * 16 + np.arange(16)).ravel(), np.arange(1024))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("num_pages", [1, 10])
def test_round_trip_of_runs(layout: HostLayout, page_size: int, num_pages: int) -> None:
    """A fresh allocation written and loaded back (one run each way, down to a single
    token) moves exactly; every other row keeps the sentinel."""
    ctrl = make_controller(DirectBackend(), page_size=page_size, layout=layout)
    ctrl.device_allocator.try_alloc(3 * page_size)  # device and host slot ids differ
    device = ctrl.device_allocator.try_alloc(num_pages * page_size)
    assert device is not None
    round_trip(ctrl, device)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda x: x.value)
def test_scattered_round_trip_equals_torch(layout: HostLayout, kind: AttentionKind) -> None:
    """Pages in random order into a host pool with holes, back layer by layer (short runs,
    partial ``page_first_direct`` pages): the same device and host rows as torch."""
    expected = fragmented_round_trip(TorchBackend(), layout, kind, "cpu")
    found = fragmented_round_trip(DirectBackend(), layout, kind, "cpu")
    assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_non_consecutive_layers_and_mid_page_runs(layout: HostLayout) -> None:
    """Layers 0 and 2 of host slots cut mid-page (2 slots of page 1, all of pages 2-3, 1 of
    page 4) into two device runs: only those rows move, both ways; layer 1 and every other
    row keep the sentinel."""
    ctrl = make_controller(DirectBackend(), page_size=4, num_layers=3, layout=layout)
    host = Indices(torch.arange(6, 17), IndexSpace.HOST_FULL)
    device = Indices(torch.cat([torch.arange(20, 25), torch.arange(40, 46)]),
                     IndexSpace.DEVICE_FULL)
    transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                            host_indices=host, device_indices=device, layers=(0, 1, 2))
    moved = MovedTransfer(transfer, *ctrl.move_indices(host, device))
    before = device_rows(ctrl.device_pool).clone()
    ctrl.backend.copy(moved, [0, 2], D2H, [])
    rows = host_rows(ctrl.host_pool)
    assert torch.equal(rows[host.tensor][:, :, [0, 2]], before[device.tensor][:, :, [0, 2]])
    assert (rows[:, :, 1] == SENTINEL).all()
    assert (untouched(rows, host.tensor) == SENTINEL).all()
    ctrl.device_pool.data.fill_(SENTINEL)
    ctrl.backend.copy(moved, [0, 2], H2D, [])
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[device.tensor][:, :, [0, 2]], before[device.tensor][:, :, [0, 2]])
    assert (after[:, :, 1] == SENTINEL).all()
    assert (untouched(after, device.tensor) == SENTINEL).all()


def test_a_run_is_one_copy_per_component_and_layer_block(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A layer_first run: the write of all layers is one 2D copy (components and layers
    collapse), each layer of a layer-wise load one copy of its K and V rows of the run."""
    ctrl = make_controller(DirectBackend(), page_size=4, num_layers=3)
    copies = issued_copies(monkeypatch)
    ctrl.device_allocator.try_alloc(8)
    device = ctrl.device_allocator.try_alloc(40)
    assert device is not None
    round_trip(ctrl, device)
    row_bytes = ctrl.device_pool.geometry.row_bytes
    write, *loads = copies
    assert write[4:] == (40 * row_bytes, 2 * 3)  # width, height: K and V of 3 layers
    assert len(loads) == 3  # one group per layer (3 layers)
    assert all(load[4:] == (40 * row_bytes, 2) for load in loads)


def test_indices_stay_on_the_cpu() -> None:
    """The runs are found on the CPU; no index is uploaded for a kernel."""
    ctrl = make_controller(DirectBackend())
    device = ctrl.device_allocator.try_alloc(5)
    host = ctrl.host_pool.allocator.try_alloc(5)
    assert device is not None and host is not None
    host_index, device_index = ctrl.move_indices(host, device)
    assert host_index.device.type == device_index.device.type == "cpu"


def test_configured_direct_is_refused_for_cpu_pools() -> None:
    with pytest.raises(ValueError, match="io_backend 'direct' cannot serve pools on device cpu"):
        make_backend("direct", torch.device("cpu"))


def auto_with_direct(rows: list[AutoRow]) -> AutoBackend:
    found = {"torch": TorchBackend(), "staged": StagedBackend(8), "direct": DirectBackend()}
    return AutoBackend(found, rows, "torch")


def transfer_of(ctrl: object, host: torch.Tensor, device: torch.Tensor) -> PoolTransfer:
    assert hasattr(ctrl, "host_pool") and hasattr(ctrl, "device_pool")
    return PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                        host_indices=Indices(host, IndexSpace.HOST_FULL),
                        device_indices=Indices(device, IndexSpace.DEVICE_FULL), layers=(0,))


def test_auto_sends_long_runs_on_layer_first_to_direct() -> None:
    """Long runs on a layer_first host go to direct whatever the table says; scattered
    pages, other layouts and a call without its pairs follow the table."""
    backend = auto_with_direct([AutoRow(H2D, HostLayout.LAYER_FIRST, True, 0, "staged")])
    ctrl = make_controller(TorchBackend(), device_pages=600, host_pages=600)
    n = 2 * DIRECT_MIN_RUN_TOKENS
    runs = transfer_of(ctrl, torch.arange(1, n + 1), torch.arange(100, 100 + n))
    pages = torch.randperm(n // 16, generator=torch.Generator().manual_seed(0))
    scattered = transfer_of(ctrl, (pages[:, None] * 16 + torch.arange(16)).flatten() + 1,
                            torch.arange(100, 100 + n))
    lf, pf = HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST
    assert backend.select(H2D, lf, n, layer_wise=True, pairs=runs).name == "direct"
    assert backend.select(D2H, lf, n, layer_wise=False, pairs=runs).name == "direct"
    assert backend.select(H2D, lf, n, layer_wise=True, pairs=scattered).name == "staged"
    assert backend.select(H2D, pf, n, layer_wise=True, pairs=runs).name == "torch"
    assert backend.select(H2D, lf, n, layer_wise=True).name == "staged"


def test_controller_runs_direct_for_runs_under_auto() -> None:
    """Through the controller: a long fresh allocation's write and load run on direct (the
    op's backend label says so) and move exactly; a short one follows the table."""
    ctrl = make_controller(auto_with_direct([]), page_size=16, device_pages=40,
                           host_pages=40)
    device = ctrl.device_allocator.try_alloc(DIRECT_MIN_RUN_TOKENS * 2)
    assert device is not None
    round_trip(ctrl, device)
    ways = ("device_to_host", "host_to_device")
    assert dict(ctrl.stats.backend_ops) == {(way, "direct"): 1 for way in ways}
    short = ctrl.device_allocator.try_alloc(16)
    assert short is not None
    fill_unique(ctrl.device_pool.data)  # the first round trip left sentinels everywhere
    ctrl.host_pool.data.fill_(SENTINEL)
    round_trip(ctrl, short)
    assert dict(ctrl.stats.backend_ops) == {(way, name): 1 for way in ways
                                            for name in ("direct", "torch")}


def test_a_run_shape_is_planned_once_per_pool_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writes of 16-token runs at different slots plan the run's copies once; the second
    op shifts them (and still moves exactly the right rows)."""
    planned: list[object] = []
    plan = copy2d.CopyPlanner.plan

    def counted(self: copy2d.CopyPlanner, host: torch.Tensor, staged: torch.Tensor
                ) -> list[copy2d.Copy2D]:
        planned.append(host.shape)
        return plan(self, host, staged)

    monkeypatch.setattr(copy2d.CopyPlanner, "plan", counted)
    ctrl = make_controller(DirectBackend(), page_size=4)
    first = ctrl.device_allocator.try_alloc(16)
    ctrl.device_allocator.try_alloc(8)
    second = ctrl.device_allocator.try_alloc(16)
    assert first is not None and second is not None
    before = device_rows(ctrl.device_pool)
    hosts = [ctrl.write(first), ctrl.write(second)]
    ctrl.drain()
    assert len(planned) == 1
    rows = host_rows(ctrl.host_pool)
    for host, device in zip(hosts, (first, second), strict=True):
        assert host is not None
        assert torch.equal(rows[host.tensor], before[device.tensor])


def test_the_backend_keeps_no_pool_alive() -> None:
    """The shared run plans are held per pool pair by weak keys: once a controller and its
    pools are gone, the backend holds nothing of them."""
    backend = DirectBackend()
    ctrl = make_controller(backend)
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    ctrl.write(device)
    ctrl.drain()
    host_pool = weakref.ref(ctrl.host_pool)
    assert len(backend._plans) == 1
    del ctrl, device
    gc.collect()
    assert host_pool() is None and len(backend._plans) == 0
