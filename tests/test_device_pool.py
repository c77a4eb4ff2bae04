"""DeviceKVPool: buffer shapes, exact row writes, padding, refused inputs, layer waits (CPU)."""

from __future__ import annotations

import pytest
import torch

from hicache.pools import (
    AttentionKind,
    BoundsError,
    DeviceKVPool,
    IndexSpace,
    Indices,
    RowGeometry,
)

HEADS, HEAD_DIM, LATENT = 2, 4, 6
NUM_LAYERS, NUM_SLOTS = 3, 8
SENTINEL = -7.0
MHA = RowGeometry(AttentionKind.MHA, HEADS, HEAD_DIM, 0, torch.float32)
MLA = RowGeometry(AttentionKind.MLA, 0, 0, LATENT, torch.float32)


def _pool(geometry: RowGeometry = MHA, device: str = "cpu") -> DeviceKVPool:
    """A 3-layer, 8-slot DEVICE_FULL pool named 'full'."""
    return DeviceKVPool(
        name="full", space=IndexSpace.DEVICE_FULL, num_layers=NUM_LAYERS, num_slots=NUM_SLOTS,
        geometry=geometry, device=device,
    )


def _locs(*slots: int, dtype: torch.dtype = torch.int64) -> Indices:
    """DEVICE_FULL indices of ``slots``."""
    return Indices(torch.tensor(slots, dtype=dtype), IndexSpace.DEVICE_FULL)


def _rows(n: int, start: float, geometry: RowGeometry = MHA) -> torch.Tensor:
    """``n`` position-dependent rows shaped as set_kv takes them."""
    shape = (n, HEADS, HEAD_DIM) if geometry.kind is AttentionKind.MHA else (n, LATENT)
    count = n * geometry.row_elems
    return torch.arange(start, start + count, dtype=torch.float32).reshape(shape)


# ---- shapes ------------------------------------------------------------------------------


def test_mha_storage_and_views_have_the_documented_shapes() -> None:
    """MHA data is [2, layers, slots, heads*dim]; K/V are [slots, heads, dim] views of it."""
    pool = _pool()
    assert pool.data.shape == (2, NUM_LAYERS, NUM_SLOTS, HEADS * HEAD_DIM)
    assert pool.key_buffer(1).shape == (NUM_SLOTS, HEADS, HEAD_DIM)
    assert pool.value_buffer(1).shape == (NUM_SLOTS, HEADS, HEAD_DIM)
    assert pool.layer_rows(1, 2).shape == (NUM_SLOTS, HEADS * HEAD_DIM)
    assert pool.key_buffer(2).data_ptr() == pool.data[0, 2].data_ptr()
    assert pool.value_buffer(2).data_ptr() == pool.data[1, 2].data_ptr()


def test_mla_storage_and_view_have_the_documented_shapes() -> None:
    """MLA data is [1, layers, slots, latent]; the latent buffer is [slots, latent]."""
    pool = _pool(MLA)
    assert pool.data.shape == (1, NUM_LAYERS, NUM_SLOTS, LATENT)
    assert pool.latent_buffer(0).shape == (NUM_SLOTS, LATENT)
    assert pool.latent_buffer(2).data_ptr() == pool.data[0, 2].data_ptr()


def test_sizes_count_every_component_and_layer() -> None:
    """size_bytes and the geometry's byte counts follow the row shape and dtype."""
    pool = _pool()
    assert MHA.row_bytes == HEADS * HEAD_DIM * 4
    assert MHA.token_bytes(NUM_LAYERS) == 2 * NUM_LAYERS * HEADS * HEAD_DIM * 4
    assert pool.size_bytes == NUM_SLOTS * MHA.token_bytes(NUM_LAYERS)


def test_host_space_is_refused() -> None:
    """A device pool cannot be built in a host index space."""
    with pytest.raises(ValueError, match=r"device pool 'h' cannot use host space HOST_FULL"):
        DeviceKVPool(name="h", space=IndexSpace.HOST_FULL, num_layers=1, num_slots=4,
                     geometry=MHA, device="cpu")


# ---- writes --------------------------------------------------------------------------------


def test_set_kv_writes_exactly_the_given_rows() -> None:
    """K and V land in rows 5 and 2 of layer 1; every other row keeps the sentinel."""
    pool = _pool()
    pool.data.fill_(SENTINEL)
    k, v = _rows(2, 100.0), _rows(2, 200.0)
    pool.set_kv(1, _locs(5, 2), k, v)
    expected = torch.full_like(pool.data, SENTINEL)
    expected[0, 1, 5], expected[0, 1, 2] = k[0].flatten(), k[1].flatten()
    expected[1, 1, 5], expected[1, 1, 2] = v[0].flatten(), v[1].flatten()
    expected[:, 1, 0] = 0.0  # the padding slot of the written layer is cleared
    assert torch.equal(pool.data, expected)


def test_set_kv_accepts_int32_locations() -> None:
    """int32 locations write the same rows as int64 ones."""
    pool = _pool()
    k, v = _rows(1, 1.0), _rows(1, 9.0)
    pool.set_kv(0, _locs(3, dtype=torch.int32), k, v)
    assert torch.equal(pool.key_buffer(0)[3], k[0])
    assert torch.equal(pool.value_buffer(0)[3], v[0])


def test_write_aimed_at_padding_slot_leaves_it_zero() -> None:
    """A padded batch row pointing at slot 0 leaves slot 0 all zero; the real row is written."""
    pool = _pool()
    pool.data.fill_(SENTINEL)
    k, v = _rows(2, 1.0), _rows(2, 50.0)
    pool.set_kv(2, _locs(0, 4), k, v)
    assert torch.equal(pool.data[:, 2, 0], torch.zeros(2, HEADS * HEAD_DIM))
    assert torch.equal(pool.key_buffer(2)[4], k[1])
    assert torch.equal(pool.value_buffer(2)[4], v[1])


def test_mla_set_kv_writes_the_latent_rows() -> None:
    """MLA set_kv writes only k into the latent rows and leaves the others alone."""
    pool = _pool(MLA)
    pool.data.fill_(SENTINEL)
    latent = _rows(2, 10.0, MLA)
    pool.set_kv(0, _locs(6, 1), latent)
    expected = torch.full_like(pool.data, SENTINEL)
    expected[0, 0, 6], expected[0, 0, 1] = latent[0], latent[1]
    expected[0, 0, 0] = 0.0
    assert torch.equal(pool.data, expected)


def test_empty_set_kv_is_a_no_op() -> None:
    """Zero locations with zero rows change nothing."""
    pool = _pool()
    pool.data.fill_(SENTINEL)
    pool.set_kv(1, _locs(), _rows(0, 0.0), _rows(0, 0.0))
    assert torch.equal(pool.data, torch.full_like(pool.data, SENTINEL))


def test_wrong_dtype_rows_raise() -> None:
    """float16 rows for a float32 pool name both dtypes and devices."""
    pool = _pool()
    k = _rows(1, 0.0).half()
    with pytest.raises(ValueError, match=r"set_kv on pool 'full': rows must be torch\.float32 "
                                         r"on cpu, got torch\.float16 on cpu"):
        pool.set_kv(0, _locs(3), k, k)


def test_wrong_shape_k_raises() -> None:
    """K with the wrong row width names the component, the expected and the given shape."""
    pool = _pool()
    with pytest.raises(ValueError, match=r"component 0 must hold 2 rows of 8 elements, "
                                         r"got shape \(2, 2, 3\)"):
        pool.set_kv(0, _locs(3, 4), torch.zeros(2, 2, 3), _rows(2, 0.0))


def test_row_count_mismatch_raises() -> None:
    """Three rows for two locations are refused."""
    pool = _pool()
    with pytest.raises(ValueError, match=r"component 0 must hold 2 rows of 8 elements, "
                                         r"got shape \(3, 2, 4\)"):
        pool.set_kv(0, _locs(3, 4), _rows(3, 0.0), _rows(3, 0.0))


def test_bad_v_raises_before_k_is_written() -> None:
    """A V of the wrong shape is refused and K is not half-written."""
    pool = _pool()
    with pytest.raises(ValueError, match=r"component 1 must hold 1 rows of 8 elements, "
                                         r"got shape \(1, 2, 3\)"):
        pool.set_kv(0, _locs(3), _rows(1, 5.0), torch.zeros(1, 2, 3))
    assert torch.equal(pool.data, torch.zeros_like(pool.data))


def test_mha_without_v_raises() -> None:
    """An MHA write needs V."""
    pool = _pool()
    with pytest.raises(ValueError, match=r"set_kv on MHA pool 'full': v is required"):
        pool.set_kv(0, _locs(3), _rows(1, 0.0))
    assert torch.equal(pool.data, torch.zeros_like(pool.data))


def test_mla_with_v_raises() -> None:
    """An MLA write takes only the latent row."""
    pool = _pool(MLA)
    latent = _rows(1, 0.0, MLA)
    with pytest.raises(ValueError, match=r"set_kv on MLA pool 'full': pass only k"):
        pool.set_kv(0, _locs(3), latent, latent)


def test_set_kv_refuses_other_space() -> None:
    """SWA indices are refused by a full pool's set_kv."""
    pool = _pool()
    swa = Indices(torch.tensor([3]), IndexSpace.DEVICE_SWA)
    with pytest.raises(ValueError, match=r"set_kv\(layer=0\): pool 'full' takes indices in "
                                         r"space DEVICE_FULL, got DEVICE_SWA"):
        pool.set_kv(0, swa, _rows(1, 0.0), _rows(1, 0.0))


def test_set_kv_refuses_layer_out_of_range() -> None:
    """Layer 3 of a 3-layer pool is refused, naming the valid range."""
    pool = _pool()
    with pytest.raises(ValueError, match=r"pool 'full': layer 3 out of range \(0\.\.2\)"):
        pool.set_kv(3, _locs(3), _rows(1, 0.0), _rows(1, 0.0))


def test_accessor_refuses_negative_layer() -> None:
    """A negative layer does not silently alias the last layer."""
    pool = _pool()
    with pytest.raises(ValueError, match=r"pool 'full': layer -1 out of range \(0\.\.2\)"):
        pool.key_buffer(-1)


@pytest.mark.parametrize("slot", [8, 9, -1, -8])
def test_bounds_refused_without_debug_flag(monkeypatch: pytest.MonkeyPatch, slot: int) -> None:
    """Slots past an 8-slot pool or negative (-1 aliases the last row, -8 the first) are
    refused with the flag unset, naming the op, value and bound; no row changes."""
    monkeypatch.delenv("HICACHE_DEBUG_CHECKS", raising=False)
    pool = _pool()
    pool.set_kv(0, _locs(7), _rows(1, 5.0), _rows(1, 5.0))
    before = pool.data.clone()
    with pytest.raises(BoundsError, match=rf"set_kv\(layer=0\): slot {slot} is "
                                          rf"(out of range|negative) for pool 'full' "
                                          rf"\(valid slots are 0\.\.7\)"):
        pool.set_kv(0, _locs(3, slot), _rows(2, 1.0), _rows(2, 1.0))
    assert torch.equal(pool.data, before)


def test_forward_locs_are_checked_once_and_owned() -> None:
    """forward_locs checks the slots, copies them (refilling the source changes nothing)
    and set_kv writes through it."""
    pool = _pool()
    buffer = torch.tensor([3, 4], dtype=torch.int32)
    locs = pool.forward_locs(Indices(buffer, IndexSpace.DEVICE_FULL))
    buffer.fill_(6)
    rows = _rows(2, 2.0)
    pool.set_kv(0, locs, rows, rows)
    assert torch.equal(pool.key_buffer(0)[3:5], rows)
    assert pool.key_buffer(0)[6].eq(0).all()
    with pytest.raises(BoundsError, match=r"forward_locs: slot 8 is out of range"):
        pool.forward_locs(_locs(8))


def test_forward_locs_of_another_pool_are_refused() -> None:
    """set_kv refuses ForwardLocs made by another pool."""
    pool, other = _pool(), _pool()
    locs = other.forward_locs(_locs(3))
    with pytest.raises(ValueError, match=r"made by another pool"):
        pool.set_kv(0, locs, _rows(1, 1.0), _rows(1, 1.0))


# ---- accessors -----------------------------------------------------------------------------


def test_key_buffer_on_mla_raises() -> None:
    """key_buffer needs an MHA pool."""
    with pytest.raises(ValueError, match=r"key_buffer needs a mha pool; pool 'full' is mla"):
        _pool(MLA).key_buffer(0)


def test_value_buffer_on_mla_raises() -> None:
    """value_buffer needs an MHA pool."""
    with pytest.raises(ValueError, match=r"value_buffer needs a mha pool; pool 'full' is mla"):
        _pool(MLA).value_buffer(0)


def test_latent_buffer_on_mha_raises() -> None:
    """latent_buffer needs an MLA pool."""
    with pytest.raises(ValueError, match=r"latent_buffer needs a mla pool; pool 'full' is mha"):
        _pool().latent_buffer(0)


def test_mha_accessors_and_set_kv_call_the_layer_waiter() -> None:
    """key_buffer, value_buffer and set_kv each wait on their layer; layer_rows does not."""
    pool = _pool()
    waited: list[int] = []
    pool.register_layer_waiter(waited.append)
    pool.key_buffer(2)
    pool.value_buffer(1)
    pool.set_kv(0, _locs(3), _rows(1, 0.0), _rows(1, 0.0))
    pool.layer_rows(0, 2)
    assert waited == [2, 1, 0]


def test_mla_accessor_and_set_kv_call_the_layer_waiter() -> None:
    """latent_buffer and an MLA set_kv each wait on their layer."""
    pool = _pool(MLA)
    waited: list[int] = []
    pool.register_layer_waiter(waited.append)
    pool.latent_buffer(1)
    pool.set_kv(2, _locs(3), _rows(1, 0.0, MLA))
    assert waited == [1, 2]


def test_unregistered_waiter_is_not_called() -> None:
    """register_layer_waiter(None) removes the waiter."""
    pool = _pool()
    waited: list[int] = []
    pool.register_layer_waiter(waited.append)
    pool.register_layer_waiter(None)
    pool.key_buffer(0)
    assert waited == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pool_on_bare_cuda_accepts_indices_on_the_current_gpu() -> None:
    """A pool built on "cuda" accepts rows and indices whose device is "cuda:<index>"."""
    pool = _pool(device="cuda")
    locs = _locs(3).to(f"cuda:{torch.cuda.current_device()}")
    k = _rows(1, 1.0).to(locs.device)
    pool.set_kv(0, locs, k, k)
    assert torch.equal(pool.key_buffer(0)[3].cpu(), k[0].cpu())


@pytest.mark.parametrize("layer", [-1, NUM_LAYERS, NUM_LAYERS + 5])
def test_every_layer_accessor_refuses_a_layer_the_pool_lacks(layer: int) -> None:
    """The buffer accessors and set_kv name the layer and the valid range (a negative layer
    would alias the last one, one past the end is a raw index error); the first and the
    last layer are served."""
    pool, mla = _pool(), _pool(MLA)
    calls = [lambda: pool.key_buffer(layer), lambda: pool.value_buffer(layer),
             lambda: mla.latent_buffer(layer),
             lambda: pool.set_kv(layer, _locs(1, 2), _rows(2, 1.0), _rows(2, 2.0))]
    for call in calls:
        with pytest.raises(ValueError, match=rf"pool 'full': layer {layer} out of range "
                                             rf"\(0\.\.{NUM_LAYERS - 1}\)$"):
            call()
    for edge in (0, NUM_LAYERS - 1):
        assert pool.key_buffer(edge).shape[0] == NUM_SLOTS
        assert mla.latent_buffer(edge).shape[0] == NUM_SLOTS
