"""Aligned slot tensors of the hybrid controller: joined parts and a part placed in a tail."""

from __future__ import annotations

import torch

from hicache.controller.aligned_slots import cat_space, empty_indices, in_tail, scatter_aligned
from hicache.pools import IndexSpace, Indices


def _ids(values: list[int], dtype: torch.dtype = torch.int64) -> Indices:
    return Indices(torch.tensor(values, dtype=dtype), IndexSpace.HOST_SWA)


def test_cat_space_joins_in_order_as_int64_in_the_space_given() -> None:
    got = cat_space([_ids([4, 5]), _ids([9], torch.int32), _ids([])], IndexSpace.DEVICE_SWA)
    assert got.space is IndexSpace.DEVICE_SWA
    assert got.tensor.dtype == torch.int64 and got.tensor.tolist() == [4, 5, 9]


def test_cat_space_of_one_int64_part_is_that_tensor_and_of_none_is_empty() -> None:
    part = _ids([7, 8])
    alone = cat_space([empty_indices(IndexSpace.HOST_SWA), part], IndexSpace.HOST_SWA)
    assert alone.tensor is part.tensor  # no copy: the caller owns what it keeps
    narrow = cat_space([_ids([7, 8], torch.int32)], IndexSpace.HOST_SWA)
    assert narrow.tensor.dtype == torch.int64 and narrow.tensor.tolist() == [7, 8]
    none = cat_space([empty_indices(IndexSpace.HOST_SWA)] * 2, IndexSpace.DEVICE_FULL)
    assert none.tensor.numel() == 0 and none.tensor.dtype == torch.int64
    assert none.space is IndexSpace.DEVICE_FULL


def test_in_tail_matches_the_mask_it_replaced() -> None:
    for num_tokens, start in ((6, 6), (6, 2), (6, 0), (0, 0)):
        part = _ids(list(range(100, 100 + num_tokens - start)))
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        mask[start:] = True
        by_slice = in_tail(part, num_tokens, start, IndexSpace.DEVICE_SWA)
        by_mask = scatter_aligned(part, mask, IndexSpace.DEVICE_SWA)
        assert by_slice.tensor.tolist() == by_mask.tensor.tolist()
        assert by_slice.tensor.tolist()[:start] == [0] * start
