"""Numpy record views of a CPU pool's rows: they alias the pool, in both host layouts and
for dtypes numpy lacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from controller_helpers import SENTINEL, device_rows, host_rows, make_controller, untouched

from hicache.controller import TorchBackend
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    IndexSpace,
    Indices,
    RowGeometry,
)
from hicache.pools.row_records import row_records


# page_first_direct has no flat [slots] view of a layer: its CPU copies go through torch
@pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_records_copy_rows_between_pools(layout: HostLayout, dtype: torch.dtype) -> None:
    """Copying records moves exactly the indexed rows of one component and layer."""
    geometry = RowGeometry(AttentionKind.MHA, 2, 4, 0, dtype)
    device = DeviceKVPool(name="full", space=IndexSpace.DEVICE_FULL, num_layers=3, num_slots=12,
                          geometry=geometry, device="cpu")
    host = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=3, num_pages=5,
                      page_size=2, geometry=geometry, layout=layout, pin=False)
    source = torch.arange(device.data.numel(), dtype=torch.float32) % 200
    device.data.copy_(source.view(device.data.shape).to(dtype))
    host.data.fill_(-1)
    host.layer_records(1, 2)[np.array([4, 9])] = device.layer_records(1, 2)[np.array([7, 3])]
    expected = torch.full_like(host.data, -1)
    rows = host.layer_rows(1, 2)
    assert torch.equal(rows[4], device.layer_rows(1, 2)[7])
    assert torch.equal(rows[9], device.layer_rows(1, 2)[3])
    rows[4], rows[9] = -1, -1  # everything else untouched
    assert torch.equal(host.data.float(), expected.float())


def test_records_alias_the_rows() -> None:
    """A record written is the row written: no copy in between."""
    rows = torch.zeros(6, 3)
    records = row_records(rows)
    assert records.shape == (6,)
    records[2] = row_records(torch.ones(1, 3))[0]
    assert rows[2].tolist() == [1.0, 1.0, 1.0] and rows.sum() == 3


def test_closed_host_pool_drops_its_records() -> None:
    """close() forgets the record views, so no copy reaches released memory through them."""
    geometry = RowGeometry(AttentionKind.MLA, 0, 0, 4, torch.float32)
    host = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=1, num_pages=2,
                      page_size=1, geometry=geometry, layout=HostLayout.LAYER_FIRST, pin=False)
    host.layer_records(0, 0)
    host.close()
    with pytest.raises(RuntimeError, match="closed"):
        host.layer_records(0, 0)


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("one_run", [True, False])
def test_cpu_moves_of_many_rows_land_in_place(layout: HostLayout, one_run: bool) -> None:
    """A write and a layer-wise load of 512 rows on a CPU (one block copy when the slots
    are one run, a record per row otherwise) move exactly those rows, every layer."""
    ctrl = make_controller(TorchBackend(), page_size=16, device_pages=100, host_pages=40,
                           num_layers=3, layout=layout)
    taken = ctrl.device_allocator.try_alloc(1024)
    assert taken is not None
    pages = taken.tensor.view(-1, 16)
    chosen = pages[:32] if one_run else pages[::2]  # 32 pages, in one run or every other
    device = Indices(chosen.reshape(-1).clone(), IndexSpace.DEVICE_FULL)
    host = ctrl.write(device)
    assert host is not None
    ctrl.drain()
    written = host_rows(ctrl.host_pool)
    assert torch.equal(written[host.tensor], device_rows(ctrl.device_pool)[device.tensor])
    assert (untouched(written, host.tensor) == SENTINEL).all()
    loaded = ctrl.load(host)
    assert loaded is not None
    ctrl.start_loading()
    ctrl.drain()
    rows = device_rows(ctrl.device_pool)
    assert torch.equal(rows[loaded.tensor], rows[device.tensor])
