"""Index copies and joins on the calling thread (``hicache.pools.serial_copies``): new
tensors with the values, below and beyond torch's grain, and no torch copy beyond it; a
match's device slots are the tree's values in a tensor of their own at any length."""

from __future__ import annotations

import pytest
import torch

from hicache.pools import IndexSpace, Indices
from hicache.pools.serial_copies import GRAIN, int64_copy, joined

SIZES = [0, 5, GRAIN, GRAIN + 16, 3 * GRAIN]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_int64_copy_is_a_new_int64_tensor_with_the_values(size: int, dtype: torch.dtype
                                                          ) -> None:
    source = torch.arange(size, dtype=dtype) * 3
    copy = int64_copy(source[::1])
    assert copy.dtype is torch.int64 and torch.equal(copy, source.to(torch.int64))
    if size:
        assert copy.data_ptr() != source.data_ptr()
        source[0] = 7
        assert int(copy[0]) == 0  # its own memory


def test_int64_copy_of_a_view_copies_only_the_view() -> None:
    source = torch.arange(3 * GRAIN, dtype=torch.int64)
    view = source[GRAIN - 4:2 * GRAIN + 4]
    copy = int64_copy(view)
    assert torch.equal(copy, view) and copy.is_contiguous() and copy.numel() == GRAIN + 8


@pytest.mark.parametrize("sizes", [[5], [GRAIN], [GRAIN + 1], [GRAIN, 16], [7, 2 * GRAIN, 0]])
def test_joined_is_a_new_tensor_of_the_parts_in_order(sizes: list[int]) -> None:
    parts = [torch.arange(n, dtype=torch.int64) + 10 * i for i, n in enumerate(sizes)]
    out = joined(parts)
    assert torch.equal(out, torch.cat(parts))
    if sizes[0]:
        parts[0][0] = -1
        assert int(out[0]) == 0  # never a part's memory, even for one part


def test_beyond_the_grain_torch_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    big = torch.arange(GRAIN + 16, dtype=torch.int64)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a torch copy beyond the grain")

    monkeypatch.setattr(torch, "cat", refused)
    monkeypatch.setattr(torch.Tensor, "clone", refused)
    assert torch.equal(joined([big, big]).narrow(0, 0, big.numel()), big)
    assert int64_copy(big).numel() == big.numel()


def test_a_long_match_returns_slots_of_its_own() -> None:
    """A match of more than the grain's tokens (two nodes' slots joined, then one node's):
    the tree's slots, in a tensor no node holds."""
    from hicache.bench.scheduler import make_service

    service = make_service(capacity_tokens=4 * GRAIN, host_ratio=1.0)
    try:
        first = list(range(1, GRAIN + 1))
        longer = first + list(range(GRAIN + 1, GRAIN + 1 + 4096))
        for tokens in (first, longer):
            cached = service.match(tokens).device_indices
            new = service.alloc_device(len(tokens) - len(cached))
            assert new is not None
            slots = Indices(torch.cat([cached.tensor, new.tensor]), IndexSpace.DEVICE_FULL)
            service.insert(tokens, slots)
        match = service.match(longer)
        assert match.device_hit_tokens == len(longer)
        again = service.match(longer).device_indices
        assert torch.equal(match.device_indices.tensor, again.tensor)
        assert match.device_indices.tensor.data_ptr() != again.tensor.data_ptr()
        node_ptrs = set()
        node = match.last_device_node
        while node is not None and node.device is not None:
            node_ptrs.add(node.device.tensor.data_ptr())
            node = node.parent
        assert match.device_indices.tensor.data_ptr() not in node_ptrs
        service.step()
        service.check_integrity()
    finally:
        service.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensor_is_copied_on_its_device() -> None:
    big = torch.arange(GRAIN + 16, dtype=torch.int32, device="cuda")
    copy = int64_copy(big)
    assert copy.device == big.device and copy.dtype is torch.int64
    assert torch.equal(copy, big.to(torch.int64)) and copy.data_ptr() != big.data_ptr()
    both = joined([big, big])
    assert both.device == big.device and both.numel() == 2 * big.numel()
