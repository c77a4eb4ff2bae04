"""The row kernel's fast launch on a real GPU: a kept compiled kernel runs only for arguments
Triton specialises the same way, so every launch moves exactly the rows the entry point
would, whatever the layer range, the number of pairs or the alignment of the indices.

Skips without CUDA, without Triton, and under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from hicache.controller.kernel import INTERPRET_ENV, kernel_available
from hicache.controller.kernel_launch import fast_launch
from hicache.controller.row_copy import RowCopy
from hicache.pools import AttentionKind, HostLayout, RowGeometry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get(INTERPRET_ENV, "0") == "1",
                       reason="the fast launch is for compiled kernels, not the interpreter"),
    pytest.mark.skipif(not kernel_available(), reason="needs Triton"),
]

# 18 layers so that a layer group can begin at 16 (an integer Triton specialises as
# divisible by 16) as well as at 0, 1 (specialised as the constant 1) and others.
NUM_LAYERS = 18
NUM_SLOTS = 512
GEOMETRY = RowGeometry(AttentionKind.MHA, num_kv_heads=1, head_dim=64, latent_dim=0,
                       dtype=torch.bfloat16)
GROUPS = [(0, 1), (1, 1), (2, 2), (4, 3), (7, 9), (16, 1), (17, 1)]


@pytest.fixture
def buffers() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(device, host)`` ``[2, layers, slots, row]`` buffers (layer_first); the host one
    pinned, filled with distinct values."""
    row = GEOMETRY.row_elems
    host = torch.arange(2 * NUM_LAYERS * NUM_SLOTS * row, dtype=torch.float32)
    host = host.remainder(8191).to(torch.bfloat16).view(2, NUM_LAYERS, NUM_SLOTS, row)
    host = host.pin_memory()
    device = torch.full_like(host, -1.0, device="cuda")
    yield device, host
    torch.cuda.synchronize()


def load(device: torch.Tensor, host: torch.Tensor, host_idx: torch.Tensor,
         device_idx: torch.Tensor, groups: list[tuple[int, int]]) -> None:
    """A load in layer groups through one RowCopy, on a side stream, waited for."""
    copy = RowCopy(device_data=device, host_data=host, host_layout=HostLayout.LAYER_FIRST,
                   host_indices=host_idx, device_indices=device_idx, to_host=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for begin, count in groups:
            copy.launch(begin, begin + count)
    stream.synchronize()


def expect(device: torch.Tensor, host: torch.Tensor, host_idx: torch.Tensor,
           device_idx: torch.Tensor, layers: list[int]) -> None:
    got = device.cpu()
    want = torch.full_like(got, -1.0)
    h, d = host_idx.cpu().long(), device_idx.cpu().long()
    for layer in layers:
        want[:, layer, d] = host[:, layer, h]
    assert torch.equal(got, want), "moved rows differ or an untouched row changed"


def pairs(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    host = torch.randperm(NUM_SLOTS - 1, generator=gen)[:count] + 1
    device = torch.randperm(NUM_SLOTS - 1, generator=gen)[:count] + 1
    return host.cuda(), device.cuda()


def test_layer_groups_of_every_specialisation_move_the_right_rows(
        buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Two loads of the same shape in groups beginning at 0, 1, 16 and others: the second
    runs through kept compiled kernels (the fast path is live on this Triton) and both
    move exactly their rows."""
    device, host = buffers
    fast = fast_launch()
    host_idx, device_idx = pairs(100, seed=1)
    load(device, host, host_idx, device_idx, GROUPS)
    expect(device, host, host_idx, device_idx, list(range(NUM_LAYERS)))
    device.fill_(-1.0)
    before = fast.fast_launches
    load(device, host, host_idx, device_idx, GROUPS)
    expect(device, host, host_idx, device_idx, list(range(NUM_LAYERS)))
    assert fast.enabled, "the fast launch turned itself off on this Triton"
    assert fast.fast_launches - before == len(GROUPS)


@pytest.mark.parametrize("count", [1, 16, 37], ids=["one-pair", "16-pairs", "37-pairs"])
def test_pair_counts_that_specialise_differently(
        buffers: tuple[torch.Tensor, torch.Tensor], count: int) -> None:
    """After loads of 100 pairs, loads of 1 (a constant to Triton), 16 (divisible by 16)
    and 37 pairs each get a kernel compiled for their count: exact rows."""
    device, host = buffers
    load(device, host, *pairs(100, seed=2), GROUPS)
    device.fill_(-1.0)
    host_idx, device_idx = pairs(count, seed=3)
    load(device, host, host_idx, device_idx, GROUPS[:3])
    expect(device, host, host_idx, device_idx, [0, 1, 2, 3])


def test_unaligned_index_view_after_aligned_ones(
        buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Indices that start 4 bytes into their storage (not 16-byte aligned, which Triton
    specialises on) after aligned ones of the same length: no kernel kept for the aligned
    ones serves them (the view's load compiles through Triton's entry point as many kernels
    as the aligned load did: one per layer-range specialisation of ``GROUPS``, which Triton
    keys apart by alignment), the next load of the same view runs through kept kernels
    only, exact rows."""
    device, host = buffers
    fast = fast_launch()
    host_idx, device_idx = pairs(65, seed=4)
    host32 = host_idx.to(torch.int32)
    entry_before = fast.entry_launches
    load(device, host, host32[1:].clone(), device_idx[1:].clone(), GROUPS)
    compiled = fast.entry_launches - entry_before  # no other test launches 64 int32 pairs
    assert 0 < compiled < len(GROUPS)  # groups of the same specialisations share a kernel
    device.fill_(-1.0)
    view = host32[1:]
    assert view.data_ptr() % 16 != 0
    entry_before = fast.entry_launches
    load(device, host, view, device_idx[1:], GROUPS)
    expect(device, host, view, device_idx[1:], list(range(NUM_LAYERS)))
    assert fast.enabled, "the fast launch turned itself off on this Triton"
    assert fast.entry_launches - entry_before == compiled, (
        "a kernel kept for aligned indices served unaligned ones")
    device.fill_(-1.0)
    fast_before = fast.fast_launches
    load(device, host, view, device_idx[1:], GROUPS)
    expect(device, host, view, device_idx[1:], list(range(NUM_LAYERS)))
    assert fast.fast_launches - fast_before == len(GROUPS)
