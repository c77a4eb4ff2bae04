"""HostKVPool pinning on a machine with a GPU: pinned by default over its whole buffer,
unpinned when asked, and the pinned rows read back through a copy engine."""

from __future__ import annotations

import pytest
import torch

from hicache.pools import AttentionKind, HostKVPool, HostLayout, IndexSpace, RowGeometry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GEOMETRY = RowGeometry(AttentionKind.MHA, 2, 8, 0, torch.bfloat16)


def _pool(pin: bool | None) -> HostKVPool:
    return HostKVPool(name="h", space=IndexSpace.HOST_FULL, num_layers=3, num_pages=64,
                      page_size=16, geometry=GEOMETRY, layout=HostLayout.LAYER_FIRST, pin=pin)


@pytest.mark.parametrize("pin", [None, True], ids=["default", "asked"])
def test_the_whole_buffer_is_pinned(pin: bool | None) -> None:
    """Its first and last bytes are page-locked (the registration covers every byte, not
    every element), and a non-blocking copy of the last rows reads them."""
    pool = _pool(pin)
    try:
        assert pool.is_pinned
        flat = pool.data.view(-1)
        assert flat[:1].is_pinned() and flat[-1:].is_pinned()
        flat[-8:] = torch.arange(8, dtype=flat.dtype)
        copied = flat[-8:].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(copied.cpu(), torch.arange(8, dtype=flat.dtype))
    finally:
        pool.close()
    assert not pool.is_pinned


def test_pin_false_leaves_the_buffer_pageable() -> None:
    pool = _pool(False)
    try:
        assert not pool.is_pinned
        assert not pool.data.is_pinned()
    finally:
        pool.close()
