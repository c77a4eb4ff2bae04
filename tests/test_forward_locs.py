"""ForwardLocs made from slots on the CPU: checked at once, a run written by slice copies
that leave the padding slot alone, anything else by the indexed write; every layer's rows
equal those of a plain set_kv (CPU, and on CUDA with slots given on the CPU)."""

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
NUM_LAYERS, NUM_SLOTS = 3, 16
MHA = RowGeometry(AttentionKind.MHA, HEADS, HEAD_DIM, 0, torch.float32)
MLA = RowGeometry(AttentionKind.MLA, 0, 0, LATENT, torch.float32)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _pool(device: str, geometry: RowGeometry = MHA) -> DeviceKVPool:
    return DeviceKVPool(name="full", space=IndexSpace.DEVICE_FULL, num_layers=NUM_LAYERS,
                        num_slots=NUM_SLOTS, geometry=geometry, device=device)


def _locs(*slots: int, dtype: torch.dtype = torch.int64) -> Indices:
    """DEVICE_FULL indices of ``slots``, on the CPU."""
    return Indices(torch.tensor(slots, dtype=dtype), IndexSpace.DEVICE_FULL)


def _rows(n: int, start: float, device: str, geometry: RowGeometry = MHA) -> torch.Tensor:
    shape = (n, HEADS, HEAD_DIM) if geometry.kind is AttentionKind.MHA else (n, LATENT)
    count = n * geometry.row_elems
    return torch.arange(start, start + count, dtype=torch.float32,
                        device=device).reshape(shape)


def _write_every_layer(pool: DeviceKVPool, locs: object, n: int) -> None:
    for layer in range(NUM_LAYERS):
        k = _rows(n, 1000.0 * layer, str(pool.device.type), pool.geometry)
        if pool.geometry.kind is AttentionKind.MHA:
            pool.set_kv(layer, locs, k, k + 0.5)  # type: ignore[arg-type]
        else:
            pool.set_kv(layer, locs, k)  # type: ignore[arg-type]


def _same_as_plain(device: str, slots: tuple[int, ...], geometry: RowGeometry = MHA,
                   dtype: torch.dtype = torch.int64) -> DeviceKVPool:
    """Write every layer through ForwardLocs of CPU ``slots`` and through plain set_kv with
    the slots on the pool's device into a second pool; the two pools must be equal."""
    fast, plain = _pool(device, geometry), _pool(device, geometry)
    _write_every_layer(fast, fast.forward_locs(_locs(*slots, dtype=dtype)), len(slots))
    on_device = Indices(torch.tensor(slots, dtype=dtype, device=device),
                        IndexSpace.DEVICE_FULL)
    _write_every_layer(plain, on_device, len(slots))
    assert torch.equal(fast.data, plain.data)
    fast.raise_if_tripped()
    return fast


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_of_slots_gets_a_span_and_writes_the_rows_of_a_plain_set_kv(device: str) -> None:
    pool = _same_as_plain(device, (4, 5, 6, 7, 8))
    locs = pool.forward_locs(_locs(4, 5, 6, 7, 8))
    assert locs.span == (4, 9)
    assert locs.full.tensor.device == pool.device and locs.full.tensor.dtype == torch.int64
    assert torch.equal(locs.full.tensor.cpu(), torch.arange(4, 9))
    assert not pool.data[:, :, 0].any()  # the padding slot was never written


@pytest.mark.parametrize("device", DEVICES)
def test_int32_slots_and_mla_rows_take_the_span_too(device: str) -> None:
    pool = _same_as_plain(device, (2, 3), geometry=MLA, dtype=torch.int32)
    assert pool.forward_locs(_locs(2, 3, dtype=torch.int32)).span == (2, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots", [(7, 3, 9), (3, 4, 6), (5, 4), (0, 1, 2), (9,)])
def test_only_a_run_past_the_padding_takes_the_span(
        device: str, slots: tuple[int, ...]) -> None:
    """Out of order, with a gap, descending, starting at the padding slot: no span (a single
    slot past the padding is a run of one); the rows match a plain set_kv, and the padding
    slot is clear after every write."""
    pool = _same_as_plain(device, slots)
    locs = pool.forward_locs(_locs(*slots))
    is_run = slots[0] > 0 and list(slots) == list(range(slots[0], slots[0] + len(slots)))
    assert (locs.span is not None) == is_run
    assert not pool.data[:, :, 0].any()


@pytest.mark.parametrize("device", DEVICES)
def test_no_slots_make_no_span_and_write_nothing(device: str) -> None:
    pool = _pool(device)
    locs = pool.forward_locs(_locs())
    assert locs.span is None and len(locs) == 0
    _write_every_layer(pool, locs, 0)
    assert not pool.data.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [-1, NUM_SLOTS])
def test_a_bad_slot_on_the_cpu_raises_at_forward_locs_on_any_device(device: str,
                                                                   bad: int) -> None:
    """Checked on the CPU at once, even for a GPU pool (whose own indices are checked later,
    on the GPU): nothing was written, nothing is left to raise at poll time."""
    pool = _pool(device)
    with pytest.raises(BoundsError, match=rf"forward_locs: slot {bad} "):
        pool.forward_locs(_locs(3, bad))
    assert not pool.data.any()
    pool.raise_if_tripped()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_the_wrong_shape_are_refused_before_either_component_is_written(
        device: str) -> None:
    pool = _pool(device)
    locs = pool.forward_locs(_locs(4, 5, 6))
    assert locs.span is not None
    k = _rows(3, 1.0, device)
    with pytest.raises(ValueError, match=r"component 1 must hold 3 rows"):
        pool.set_kv(0, locs, k, k[:2])
    with pytest.raises(ValueError, match=r"layer 3 out of range"):
        pool.set_kv(NUM_LAYERS, locs, k, k)
    with pytest.raises(ValueError, match=r"v is required"):
        pool.set_kv(0, locs, k)
    assert not pool.data.any()


@pytest.mark.parametrize("device", DEVICES)
def test_refilling_the_callers_buffer_changes_neither_the_slots_nor_the_span(
        device: str) -> None:
    pool = _pool(device)
    buffer = torch.tensor([4, 5], dtype=torch.int64)
    locs = pool.forward_locs(Indices(buffer, IndexSpace.DEVICE_FULL))
    buffer.copy_(torch.tensor([10, 12]))
    assert locs.span == (4, 6)
    assert locs.full.tensor.cpu().tolist() == [4, 5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_refilling_a_device_buffer_changes_no_slot_either(dtype: torch.dtype) -> None:
    """The forward's slots in a buffer on the pool's GPU (checked there, no span): the
    ForwardLocs own a copy, so a refill before the writes moves no row."""
    pool = _pool("cuda")
    buffer = torch.tensor([9, 4, 7], dtype=dtype, device="cuda")
    locs = pool.forward_locs(Indices(buffer, IndexSpace.DEVICE_FULL))
    buffer.copy_(torch.tensor([1, 2, 3], dtype=dtype))
    assert locs.span is None and locs.full.tensor.cpu().tolist() == [9, 4, 7]
    rows = _rows(3, 1.0, "cuda")
    pool.set_kv(0, locs, rows, rows + 100)
    assert torch.equal(pool.key_buffer(0)[[9, 4, 7]], rows)
    assert not pool.key_buffer(0)[[1, 2, 3]].any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_span_write_waits_for_the_layers_load_first(device: str) -> None:
    pool = _pool(device)
    waited: list[int] = []
    pool.register_layer_waiter(waited.append)
    locs = pool.forward_locs(_locs(4, 5))
    k = _rows(2, 1.0, device)
    pool.set_kv(2, locs, k, k)
    assert waited == [2]


@pytest.mark.parametrize("device", DEVICES)
def test_forward_locs_are_read_only_and_know_their_length(device: str) -> None:
    pool = _pool(device)
    for locs, n in ((pool.forward_locs(_locs(4, 5, 6)), 3),
                    (pool.forward_locs(_locs(6, 4)), 2)):
        assert len(locs) == n
        with pytest.raises(AttributeError, match=r"ForwardLocs is read-only \(tried to set "
                                                 r"span\)"):
            locs.span = (1, 2)  # type: ignore[misc]
        with pytest.raises(AttributeError, match=r"read-only \(tried to set full\)"):
            locs.full = locs.full  # type: ignore[misc]


def test_forward_locs_need_their_slots_or_a_span_and_a_device() -> None:
    from hicache.pools import ForwardLocs
    pool = _pool("cpu")
    with pytest.raises(ValueError, match=r"give the slots, or their span and device"):
        ForwardLocs(None, None, pool, 0, (2, 4))
    with pytest.raises(ValueError, match=r"give the slots, or their span and device"):
        ForwardLocs(None, None, pool, 0, None, pool.device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_span_on_a_gpu_pool_is_made_on_the_device_when_first_read() -> None:
    """A run of CPU slots for a GPU pool uploads nothing when the handle is made (the
    writes are slice copies); ``full`` makes the run on the device when read, once."""
    pool = _pool("cuda")
    locs = pool.forward_locs(_locs(4, 5, 6))
    assert locs.span == (4, 7) and locs._full is None  # nothing on the device yet
    k = _rows(3, 1.0, "cuda")
    pool.set_kv(0, locs, k, k + 0.5)
    assert locs._full is None  # the write did not need it
    full = locs.full
    assert full.space is IndexSpace.DEVICE_FULL and full.tensor.dtype == torch.int64
    assert full.tensor.device == pool.device and full.tensor.cpu().tolist() == [4, 5, 6]
    assert locs.full is full  # made once
    assert torch.equal(pool.key_buffer(0)[4:7].cpu(), k.cpu())
    scattered = pool.forward_locs(_locs(6, 4))  # not a run: uploaded at once
    assert scattered.span is None and scattered._full is not None
    assert scattered.full.tensor.cpu().tolist() == [6, 4]
