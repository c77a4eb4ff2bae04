"""The Triton transfer kernel on a real GPU, between a device pool and a cudaHostRegister-ed host
pool, launched on a side stream as the controller does.

Skips without CUDA, without Triton, and under ``TRITON_INTERPRET=1`` (which would run these
large shapes in the CPU interpreter instead of on the GPU).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from gpu_shapes import scaled

from hicache.controller.kernel import INTERPRET_ENV, kernel_available, transfer_rows
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
    pytest.mark.skipif(
        os.environ.get(INTERPRET_ENV, "0") == "1",
        reason=f"{INTERPRET_ENV}=1 would run the kernel in the CPU interpreter; run the GPU "
        f"suite without it",
    ),
    pytest.mark.skipif(not kernel_available(), reason="needs Triton"),
]

# Under the sanitizer (gpu_shapes.scaled): 2 layers, 20 pages, 65 pairs (a tile-size tail and
# past 64), still with padding pairs; geometries, layouts and index dtypes stay the same.
NUM_LAYERS = scaled(4, 2)
PAGE_SIZE = 16
NUM_PAGES = scaled(320, 20)  # 5136 (336) device slots with the reserved page
NUM_PAIRS = scaled(4099, 65)  # not a multiple of the tile
SENTINEL_BITS = -7  # an int16 pattern no source value has (sources are non-negative)
GEOMETRIES = {
    "mha-1024": RowGeometry(AttentionKind.MHA, num_kv_heads=8, head_dim=128, latent_dim=0,
                            dtype=torch.bfloat16),
    "mla-576": RowGeometry(AttentionKind.MLA, num_kv_heads=0, head_dim=0, latent_dim=576,
                           dtype=torch.bfloat16),
}
LAYOUTS = tuple(HostLayout)


def canonical(data: torch.Tensor, layout: HostLayout) -> torch.Tensor:
    """``[C, L, S, R]`` rows of a pool buffer in any storage order (a copy, not a view, for
    page_first_direct: take it again after a transfer)."""
    return as_layer_first(data, layout)


def make_pools(geometry: RowGeometry, layout: HostLayout) -> tuple[DeviceKVPool, HostKVPool]:
    device = DeviceKVPool(
        name="full", space=IndexSpace.DEVICE_FULL, num_layers=NUM_LAYERS,
        num_slots=(NUM_PAGES + 1) * PAGE_SIZE, geometry=geometry, device="cuda",
    )
    host = HostKVPool(
        name="full", space=IndexSpace.HOST_FULL, num_layers=NUM_LAYERS, num_pages=NUM_PAGES,
        page_size=PAGE_SIZE, geometry=geometry, layout=layout, pin=True,
    )
    assert host.is_pinned
    return device, host


@pytest.fixture
def pools(request: pytest.FixtureRequest) -> Iterator[tuple[DeviceKVPool, HostKVPool]]:
    geometry_name, layout = request.param
    device, host = make_pools(GEOMETRIES[geometry_name], layout)
    yield device, host
    torch.cuda.synchronize()
    host.close()


def fill_random_bits(data: torch.Tensor, seed: int) -> None:
    """Non-negative int16 patterns below 0x4000: finite bf16 values, distinct per row."""
    gen = torch.Generator(device=data.device).manual_seed(seed)
    bits = torch.randint(0, 0x4000, data.shape, generator=gen, device=data.device,
                         dtype=torch.int16)
    data.view(torch.int16).copy_(bits)


def snapshot(data: torch.Tensor) -> torch.Tensor:
    """A CPU copy (``.cpu()`` of a host tensor would alias it)."""
    return data.to("cpu", copy=True)


def fill_sentinel(data: torch.Tensor) -> None:
    data.view(torch.int16).fill_(SENTINEL_BITS)


def random_pairs(host_slots: int, device_slots: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random distinct slots of both pools (CPU int64), with a few padding pairs mixed in."""
    gen = torch.Generator().manual_seed(seed)
    host = torch.randperm(host_slots - 1, generator=gen)[:NUM_PAIRS] + 1
    device = torch.randperm(device_slots - 1, generator=gen)[:NUM_PAIRS] + 1
    host[::97] = 0
    device[5::101] = 0
    return host, device


def expected_rows(
    dst_before: torch.Tensor, src: torch.Tensor, dst_idx: torch.Tensor, src_idx: torch.Tensor
) -> torch.Tensor:
    """CPU reference on canonical ``[C, L, S, R]`` int16 views."""
    keep = (dst_idx != 0) & (src_idx != 0)
    out = dst_before.clone()
    out[:, :, dst_idx[keep]] = src[:, :, src_idx[keep]]
    return out


def run_on_side_stream(
    device: DeviceKVPool,
    host: HostKVPool,
    host_idx: torch.Tensor,
    device_idx: torch.Tensor,
    *,
    to_host: bool,
    per_layer: bool = False,
) -> None:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ranges = [(i, i + 1) for i in range(NUM_LAYERS)] if per_layer else [(0, NUM_LAYERS)]
        for begin, end in ranges:
            transfer_rows(
                device_data=device.data, host_data=host.data, host_layout=host.layout,
                host_indices=host_idx, device_indices=device_idx,
                layer_begin=begin, layer_end=end, to_host=to_host,
            )
    stream.synchronize()


def check_transfer(
    device: DeviceKVPool, host: HostKVPool, *, to_host: bool, index_dtype: torch.dtype,
    per_layer: bool = False,
) -> None:
    host_idx, device_idx = random_pairs(host.num_slots, device.num_slots, seed=1)
    src, dst = (device.data, host.data) if to_host else (host.data, device.data)
    fill_random_bits(src, seed=2)
    fill_sentinel(dst)
    torch.cuda.synchronize()

    def views() -> tuple[torch.Tensor, torch.Tensor]:
        """(source, destination) as canonical int16 CPU copies."""
        host_view = snapshot(canonical(host.data, host.layout).view(torch.int16))
        device_view = snapshot(device.data.view(torch.int16))
        return (device_view, host_view) if to_host else (host_view, device_view)

    src_before, dst_before = views()
    run_on_side_stream(
        device, host, host_idx.cuda().to(index_dtype), device_idx.cuda(),
        to_host=to_host, per_layer=per_layer,
    )
    dst_idx, src_idx = (host_idx, device_idx) if to_host else (device_idx, host_idx)
    want = expected_rows(dst_before, src_before, dst_idx, src_idx)
    src_after, dst_after = views()
    assert torch.equal(src_after, src_before), "the source pool changed"
    assert torch.equal(dst_after, want), "moved rows differ or an untouched row changed"


def pool_params() -> list[object]:
    return [
        pytest.param((name, layout), id=f"{name}-{layout.value}")
        for name in GEOMETRIES for layout in LAYOUTS
    ]


@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("pools", pool_params(), indirect=True)
def test_transfer_matches_reference(
    pools: tuple[DeviceKVPool, HostKVPool], to_host: bool
) -> None:
    """All layers in one launch on a side stream; moved rows exact, the rest keep the sentinel."""
    device, host = pools
    index_dtype = torch.int64 if device.geometry.kind is AttentionKind.MHA else torch.int32
    check_transfer(device, host, to_host=to_host, index_dtype=index_dtype)


@pytest.mark.parametrize(
    "pools", [pytest.param(("mha-1024", layout), id=f"mha-1024-{layout.value}")
              for layout in (HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT)],
    indirect=True,
)
def test_layer_by_layer_loads(pools: tuple[DeviceKVPool, HostKVPool]) -> None:
    """A loop of single-layer loads gives the same rows as one all-layer load."""
    device, host = pools
    check_transfer(device, host, to_host=False, index_dtype=torch.int64, per_layer=True)


@pytest.mark.parametrize(
    "pools", [pytest.param(("mha-1024", HostLayout.LAYER_FIRST), id="mha-1024-layer_first")],
    indirect=True,
)
def test_caller_may_drop_indices_after_launch(pools: tuple[DeviceKVPool, HostKVPool]) -> None:
    """transfer_rows records its index tensors on the launching stream, so the caller may drop
    them at once: other code reallocating (and zeroing) that memory cannot change the copy."""
    device, host = pools
    host_idx, device_idx = random_pairs(host.num_slots, device.num_slots, seed=3)
    fill_random_bits(host.data, seed=4)
    fill_sentinel(device.data)
    torch.cuda.synchronize()
    src_before = snapshot(canonical(host.data, host.layout).view(torch.int16))
    dst_before = snapshot(device.data.view(torch.int16))
    stream = torch.cuda.Stream()
    host_gpu, device_gpu = host_idx.cuda(), device_idx.cuda()  # allocated on the current stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # keep the copy queued while the indices are reused
        transfer_rows(
            device_data=device.data, host_data=host.data, host_layout=host.layout,
            host_indices=host_gpu, device_indices=device_gpu,
            layer_begin=0, layer_end=NUM_LAYERS, to_host=False,
        )
    del host_gpu, device_gpu  # the caller's responsibility ends here
    for _ in range(8):
        junk = torch.zeros(NUM_PAIRS, dtype=torch.int64, device="cuda")
        del junk
    stream.synchronize()
    want = expected_rows(dst_before, src_before, device_idx, host_idx)
    assert torch.equal(device.data.view(torch.int16).cpu(), want)
