"""The rows set_kv takes (pools/kv_rows.py): the buffer's own shape written as is, other
shapes of the same elements reshaped, strided views written exactly, everything else
refused with the pool left unchanged (CPU)."""

from __future__ import annotations

import re

import pytest
import torch
from test_device_pool import HEAD_DIM, HEADS, MLA, SENTINEL, _locs, _pool, _rows

from hicache.pools import DeviceKVPool, ForwardLocs, IndexSpace, Indices

ROW = HEADS * HEAD_DIM


def _span_locs(pool: DeviceKVPool, first: int, n: int) -> ForwardLocs:
    """ForwardLocs of the run ``first .. first + n - 1`` (a slice write)."""
    locs = pool.forward_locs(Indices(torch.arange(first, first + n), IndexSpace.DEVICE_FULL))
    assert locs.span == (first, first + n)
    return locs


@pytest.mark.parametrize("span", [True, False])
def test_flat_rows_write_like_head_rows(span: bool) -> None:
    """[n, heads * head_dim] rows land exactly where [n, heads, head_dim] rows do."""
    shaped, flat = _pool(), _pool()
    k, v = _rows(3, 10.0), _rows(3, 50.0)
    for pool, (kk, vv) in ((shaped, (k, v)), (flat, (k.reshape(3, ROW), v.reshape(3, ROW)))):
        locs = _span_locs(pool, 2, 3) if span else _locs(6, 2, 4)
        pool.set_kv(1, locs, kk, vv)
    assert torch.equal(shaped.data, flat.data)
    assert torch.equal(flat.key_buffer(1)[2 if span else 6], k[0])


@pytest.mark.parametrize("span", [True, False])
def test_strided_rows_are_written_exactly(span: bool) -> None:
    """K and V cut from one wider tensor (a fused qkv projection's split) are written
    row for row, and every other row keeps its value."""
    pool = _pool()
    pool.data.fill_(SENTINEL)
    qkv = torch.arange(3 * 3 * ROW, dtype=torch.float32).reshape(3, 3 * ROW)
    _, k, v = qkv.split([ROW, ROW, ROW], dim=1)
    k, v = k.view(3, HEADS, HEAD_DIM), v.view(3, HEADS, HEAD_DIM)
    assert not k.is_contiguous()
    slots = [3, 4, 5] if span else [7, 1, 5]
    pool.set_kv(2, _span_locs(pool, 3, 3) if span else _locs(*slots), k, v)
    expected = torch.full_like(pool.data, SENTINEL)
    for i, slot in enumerate(slots):
        expected[0, 2, slot], expected[1, 2, slot] = k[i].flatten(), v[i].flatten()
    if not span:
        expected[:, 2, 0] = 0.0  # an indexed write clears the padding slot
    assert torch.equal(pool.data, expected)


def test_mla_rows_with_a_unit_dim_are_reshaped() -> None:
    """[n, 1, latent] MLA rows write the same as [n, latent]."""
    pool = _pool(MLA)
    rows = _rows(2, 4.0, MLA)
    pool.set_kv(0, _locs(3, 6), rows.unsqueeze(1))
    assert torch.equal(pool.latent_buffer(0)[[3, 6]], rows)


def test_rows_on_another_device_are_refused_unwritten() -> None:
    """Rows on another device (a meta tensor) are refused naming the pool's device."""
    pool = _pool()
    pool.data.fill_(SENTINEL)
    meta = torch.empty(2, HEADS, HEAD_DIM, device="meta")
    with pytest.raises(ValueError, match=r"rows must be torch.float32 on cpu, got "
                                         r"torch.float32 on meta"):
        pool.set_kv(0, _locs(1, 2), _rows(2, 1.0), meta)
    assert pool.data.eq(SENTINEL).all()


@pytest.mark.parametrize("bad", [torch.tensor(1.0), torch.zeros(2), torch.zeros(2, ROW + 1),
                                 torch.zeros(2, HEADS, HEAD_DIM + 1)])
def test_rows_of_another_width_are_refused_unwritten(bad: torch.Tensor) -> None:
    """A 0-d tensor, a vector, or rows of another width are refused with their shape."""
    pool = _pool()
    pool.data.fill_(SENTINEL)
    message = f"must hold 2 rows of {ROW} elements, got shape {tuple(bad.shape)}"
    with pytest.raises(ValueError, match=re.escape(message)):
        pool.set_kv(0, _span_locs(pool, 1, 2), bad, _rows(2, 1.0))
    assert pool.data.eq(SENTINEL).all()


def test_an_mla_pools_latent_rows_are_named_k_and_component_0() -> None:
    """MLA has one component: errors about its rows name k and component 0, never v."""
    pool = _pool(MLA)
    pool.data.fill_(SENTINEL)
    with pytest.raises(TypeError, match=r"^set_kv on pool '.*': k must be a torch.Tensor, "
                                        r"got list$"):
        pool.set_kv(0, _locs(3, 6), [[1.0]] * 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"component 0 must hold 2 rows"):
        pool.set_kv(0, _locs(3, 6), torch.ones(3, 7))
    assert (pool.data == SENTINEL).all()
