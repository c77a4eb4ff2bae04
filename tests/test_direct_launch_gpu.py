"""A row copy launched once per layer group: the first launch goes through Triton's JIT, the
later ones run the compiled kernel directly (controller/direct_launch.py). On a real GPU:
the rows are exact over every layout and both directions, the JIT runs once per copy, and a
Triton that refuses the direct call falls back to the JIT with the rows still exact.

Skips without CUDA, without Triton, and under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gpu_shapes import scaled

from hicache.controller.copy_rows_kernel import compiled_kernel
from hicache.controller.direct_launch import DirectLaunch
from hicache.controller.kernel import INTERPRET_ENV, kernel_available
from hicache.controller.row_copy import RowCopy
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    IndexSpace,
    RowGeometry,
    as_layer_first,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get(INTERPRET_ENV, "0") == "1",
                       reason=f"{INTERPRET_ENV}=1 runs kernels in the CPU interpreter"),
    pytest.mark.skipif(not kernel_available(), reason="needs Triton"),
]

NUM_LAYERS = scaled(8, 4)
PAGE_SIZE = 16
NUM_PAGES = scaled(96, 12)
NUM_PAIRS = scaled(1000, 65)  # not a multiple of the tile
GROUPS = scaled(((0, 1), (1, 2), (2, 4), (4, 8)), ((0, 1), (1, 2), (2, 4)))
GEOMETRY = RowGeometry(AttentionKind.MHA, num_kv_heads=2, head_dim=128, latent_dim=0,
                       dtype=torch.bfloat16)


@pytest.fixture(params=tuple(HostLayout), ids=lambda layout: layout.value)
def pools(request: pytest.FixtureRequest) -> Iterator[tuple[DeviceKVPool, HostKVPool]]:
    device = DeviceKVPool(name="full", space=IndexSpace.DEVICE_FULL, num_layers=NUM_LAYERS,
                          num_slots=(NUM_PAGES + 1) * PAGE_SIZE, geometry=GEOMETRY,
                          device="cuda")
    host = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=NUM_LAYERS,
                      num_pages=NUM_PAGES, page_size=PAGE_SIZE, geometry=GEOMETRY,
                      layout=request.param, pin=True)
    yield device, host
    torch.cuda.synchronize()
    host.close()


@pytest.fixture
def jit_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the JIT launches of the row kernel (one entry per launch); direct launches
    are on for the test whatever an earlier test left."""
    monkeypatch.setattr(DirectLaunch, "enabled", True)
    kernel = compiled_kernel()
    run = kernel.run
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted)
    return calls


def moved_by_groups(device: DeviceKVPool, host: HostKVPool, to_host: bool,
                    before_launches: Any = None) -> tuple[torch.Tensor, torch.Tensor, RowCopy]:
    """Random rows moved by one RowCopy launched per group of ``GROUPS`` on a side stream;
    returns (destination after, expected destination, the copy)."""
    gen = torch.Generator().manual_seed(5)
    host_idx = torch.randperm(host.num_slots - 1, generator=gen)[:NUM_PAIRS] + 1
    device_idx = torch.randperm(device.num_slots - 1, generator=gen)[:NUM_PAIRS] + 1
    host_idx[::97] = 0  # padding pairs are skipped
    src, dst = (device.data, host.data) if to_host else (host.data, device.data)
    bits = torch.randint(0, 0x4000, src.shape, generator=gen, dtype=torch.int16)
    src.view(torch.int16).copy_(bits.to(src.device))
    dst.view(torch.int16).fill_(-7)
    torch.cuda.synchronize()
    host_rows = as_layer_first(host.data, host.layout).view(torch.int16).to("cpu", copy=True)
    device_rows = device.data.view(torch.int16).to("cpu", copy=True)
    keep = (host_idx != 0) & (device_idx != 0)
    if to_host:
        want = host_rows.clone()
        want[:, :, host_idx[keep]] = device_rows[:, :, device_idx[keep]]
    else:
        want = device_rows.clone()
        want[:, :, device_idx[keep]] = host_rows[:, :, host_idx[keep]]
    copy = RowCopy(device_data=device.data, host_data=host.data, host_layout=host.layout,
                   host_indices=host_idx.cuda(), device_indices=device_idx.cuda(),
                   to_host=to_host)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for number, (begin, end) in enumerate(GROUPS):
            if number == 1 and before_launches is not None:
                before_launches(copy)
            copy.launch(begin, end)
    stream.synchronize()
    if to_host:
        got = as_layer_first(host.data, host.layout).view(torch.int16).to("cpu", copy=True)
    else:
        got = device.data.view(torch.int16).to("cpu", copy=True)
    return got, want, copy


@pytest.mark.parametrize("to_host", [False, True], ids=["h2d", "d2h"])
def test_later_launches_run_direct_with_exact_rows(
        pools: tuple[DeviceKVPool, HostKVPool], jit_runs: list[int], to_host: bool) -> None:
    """One JIT launch for the whole copy, the other groups direct; every row exact, every
    row outside the pairs untouched."""
    got, want, copy = moved_by_groups(*pools, to_host)
    assert torch.equal(got, want)
    assert len(jit_runs) == 1
    assert copy._direct is not None


def test_a_refused_direct_call_falls_back_to_the_jit(
        pools: tuple[DeviceKVPool, HostKVPool], jit_runs: list[int]) -> None:
    """A compiled kernel whose launcher refuses the call (a Triton with another API):
    direct launches turn off, every group goes through the JIT, the rows are exact."""

    class Refusing:
        function = None

        def __getitem__(self, grid: object) -> Any:
            def runner(*args: object, **kwargs: object) -> None:
                raise TypeError("launcher takes other arguments")
            return runner

    def refusing(copy: RowCopy) -> None:
        copy._direct = DirectLaunch(Refusing(), pools[0].device)

    got, want, _ = moved_by_groups(*pools, False, before_launches=refusing)
    assert torch.equal(got, want)
    assert not DirectLaunch.enabled
    assert len(jit_runs) == len(GROUPS)
