"""Triton transfer kernel: copy KV rows between a device pool and pinned host memory directly.

Pinned (``cudaHostRegister``-ed) host memory is addressable from the GPU under unified virtual
addressing, so one kernel can gather and scatter rows at token granularity across PCIe without
a staging buffer. :func:`transfer_rows` launches a *persistent* grid of at most
``num_programs`` programs: a transfer occupies only that many SMs, however many rows it moves,
which bounds how much it slows the model's compute running beside it.

Work decomposition: the pairs are cut into tiles of ``tokens_per_tile`` pairs; one work item
is (tile, layer, component) and the programs walk the items grid-stride. Consecutive items
differ in component, then layer, then tile, so the programs running at the same time touch
the same few slots (all of one token's layers are one contiguous run in a ``page_first`` host
pool, all of one page's in a ``page_first_direct`` one). Each item loads the two index tiles,
masks the padding slot and the tail, and moves a ``[tokens_per_tile, row]`` block: one load
and one store of ``tokens_per_tile * row_bytes`` (16 KiB for 8 tokens of 2 KiB rows) that
every program keeps in flight.

The kernel body and its compilation are in :mod:`hicache.controller.copy_rows_kernel`; this
module checks the arguments and plans the launch (grid, tile, warps, strides). What depends
only on the pool buffers (their checks and strides) is found once per buffer geometry, so a
launch, one per layer group of a load, costs little Python. Importing it never needs Triton.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from hicache.pools import HostLayout

from .copy_rows_kernel import INTERPRET_ENV, compiled_kernel, kernel_available

__all__ = ["INDEX_DTYPES", "INTERPRET_ENV", "MAX_TOKENS_PER_TILE", "kernel_available",
           "transfer_rows"]

INDEX_DTYPES = (torch.int32, torch.int64)
MAX_TOKENS_PER_TILE = 1024
_INT32_LIMIT = 2**31 - 1
# Bytes one thread moves per item when picking num_warps: 8 vectors of 16 bytes.
_BYTES_PER_THREAD = 128


def transfer_rows(
    *,
    device_data: torch.Tensor,
    host_data: torch.Tensor,
    host_layout: HostLayout,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    layer_begin: int,
    layer_end: int,
    to_host: bool,
    num_programs: int = 16,
    tokens_per_tile: int = 8,
) -> None:
    """Copy rows of layers ``[layer_begin, layer_end)`` between a device and a host pool buffer.

    For every pair ``i`` and every component ``c`` and layer ``l`` in range, moves
    ``device_data[c, l, device_indices[i]]`` to (``to_host=True``) or from (``False``) the host
    row of slot ``host_indices[i]`` (``host_data[c, l, s]`` for ``layer_first``,
    ``host_data[s, c, l]`` for ``page_first``, ``host_data[s // P, c, l, s % P]`` for
    ``page_first_direct`` with pages of ``P`` slots). Pairs where either index is the padding slot 0
    are skipped; an index outside ``[1, slots)`` of its pool is never dereferenced either (run
    the pools' debug bounds checks to find such bugs). Nothing else is written.

    Args:
        device_data: ``[C, L, S_dev, R]`` contiguous device pool buffer (``DeviceKVPool.data``),
            bfloat16/float16/float32, on CUDA (or CPU under the Triton interpreter).
        host_data: contiguous host pool buffer (``HostKVPool.data``), same dtype: ``[C, L,
            S_host, R]`` (``layer_first``), ``[S_host, C, L, R]`` (``page_first``) or
            ``[S_host / P, C, L, P, R]`` (``page_first_direct``). With a CUDA ``device_data``
            it is a pinned CPU tensor (``cudaHostRegister``), read and written by the GPU
            through unified addressing.
        host_layout: storage order of ``host_data``.
        host_indices: ``[n]`` int32/int64 host slots, on ``device_data.device``.
        device_indices: ``[n]`` int32/int64 device slots (dtype may differ), same device.
        layer_begin, layer_end: local layer range, ``0 <= begin <= end <= L``.
        to_host: ``True`` writes device rows to the host, ``False`` loads host rows.
        num_programs: upper bound of the persistent grid (SMs the copy may occupy).
        tokens_per_tile: pairs per work item, a power of two.

    Launches on the current CUDA stream and returns at once; never synchronises. Empty input
    launches nothing. Stream contract: the index tensors are recorded on the current stream
    (``record_stream``), so the caller may drop them right after the call; ``device_data`` and
    ``host_data`` belong to their pools, which must stay open (host memory registered) and must
    not reuse the destination slots until the caller's completion event on this stream fires.

    Raises:
        ValueError: a malformed argument (the message says what was expected).
        RuntimeError: Triton is missing, or a CPU launch without ``TRITON_INTERPRET=1``.
    """
    plan = _buffer_plan(device_data, host_data, host_layout)
    num_pairs = _check_indices(device_data, host_indices, device_indices)
    _check_launch(plan.num_layers, layer_begin, layer_end, num_programs, tokens_per_tile)
    num_layers = layer_end - layer_begin
    if num_pairs == 0 or num_layers == 0:
        return
    num_tiles = -(-num_pairs // tokens_per_tile)
    num_items = num_tiles * num_layers * plan.num_components
    if num_items > _INT32_LIMIT:
        raise ValueError(
            f"transfer_rows: {num_items} work items exceed the int32 loop bound; split the "
            f"transfer or raise tokens_per_tile (got {tokens_per_tile})"
        )
    kernel = compiled_kernel()
    if plan.on_cuda:
        stream = torch.cuda.current_stream(device_data.device)
        host_indices.record_stream(stream)
        device_indices.record_stream(stream)
    device_side = (device_data, device_indices, *plan.device_strides)
    host_side = (host_data, host_indices, *plan.host_strides)
    src, dst = (device_side, host_side) if to_host else (host_side, device_side)
    grid = (min(num_programs, num_items),)
    on_device: contextlib.AbstractContextManager[Any] = (
        torch.cuda.device(device_data.device) if plan.on_cuda else contextlib.nullcontext()
    )
    try:
        with on_device:
            kernel[grid](
                src[0], dst[0], src[1], dst[1],
                num_pairs, src[2], dst[2],
                layer_begin, num_layers, plan.num_components,
                *src[3:], *dst[3:],
                ROW=plan.row_elems, BLOCK_ROW=plan.block_row, TILE=tokens_per_tile,
                num_warps=_num_warps(tokens_per_tile * plan.block_row_bytes),
            )
    except ValueError as exc:
        if "cannot be accessed" not in str(exc):
            raise
        raise ValueError(
            f"transfer_rows: the GPU cannot address host_data ({host_data.device}, "
            f"{tuple(host_data.shape)}): it must be pinned, e.g. a HostKVPool with pin=True "
            f"(cudaHostRegister), and stay registered while transfers run"
        ) from exc


class _BufferPlan(NamedTuple):
    """What a launch needs of two pool buffers: found once per buffer geometry."""

    num_components: int
    num_layers: int
    row_elems: int
    block_row: int
    block_row_bytes: int
    on_cuda: bool
    device_strides: tuple[int, ...]
    host_strides: tuple[int, ...]


# Checked buffer geometries and their plans. The key holds everything the checks and strides
# read (shapes, strides, dtypes, devices, layout; never an object's identity), so a hit skips
# the checks safely; a pool's buffers keep one geometry for life.
_PLANS: dict[tuple[object, ...], _BufferPlan] = {}
_MAX_PLANS = 64


def _buffer_plan(device_data: torch.Tensor, host_data: torch.Tensor,
                 layout: HostLayout) -> _BufferPlan:
    """The launch plan of two checked pool buffers (``ValueError`` as :func:`_check_buffers`)."""
    if not (isinstance(layout, HostLayout) and isinstance(device_data, torch.Tensor)
            and isinstance(host_data, torch.Tensor)):
        _check_buffers(device_data, host_data, layout)  # raises, naming what is wrong
    key = (layout, device_data.shape, device_data.stride(), device_data.dtype,
           device_data.device, host_data.shape, host_data.stride(), host_data.dtype,
           host_data.device)
    plan = _PLANS.get(key)
    if plan is None:
        _check_buffers(device_data, host_data, layout)
        c, n, _, r = device_data.shape
        block_row = _next_power_of_two(r)
        plan = _BufferPlan(c, n, r, block_row, block_row * device_data.element_size(),
                           device_data.is_cuda, _strides(device_data, HostLayout.LAYER_FIRST),
                           _strides(host_data, layout))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _check_buffers(device_data: torch.Tensor, host_data: torch.Tensor, layout: HostLayout) -> None:
    if not isinstance(layout, HostLayout):
        raise ValueError(f"transfer_rows: host_layout must be a HostLayout, got {layout!r}")
    host_dims = 5 if layout is HostLayout.PAGE_FIRST_DIRECT else 4
    for name, buf, dims in (("device_data", device_data, 4), ("host_data", host_data, host_dims)):
        if not isinstance(buf, torch.Tensor) or buf.dim() != dims:
            shape = tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise ValueError(f"transfer_rows: {name} must be a {dims}-D tensor"
                             f"{' (' + layout.value + ')' if name == 'host_data' else ''}, "
                             f"got {shape}")
        if not buf.is_contiguous():
            raise ValueError(
                f"transfer_rows: {name} must be contiguous (a pool's whole buffer), got strides "
                f"{buf.stride()} for shape {tuple(buf.shape)}"
            )
    if host_data.dtype != device_data.dtype:
        raise ValueError(
            f"transfer_rows: host_data dtype must match device_data: expected "
            f"{device_data.dtype}, got {host_data.dtype}"
        )
    c, n, _, r = device_data.shape
    if layout is HostLayout.LAYER_FIRST:
        got = (host_data.shape[0], host_data.shape[1], host_data.shape[3])
    else:
        got = (host_data.shape[1], host_data.shape[2], host_data.shape[-1])
    if got != (c, n, r):
        raise ValueError(
            f"transfer_rows: (components, layers, row_elems) of host_data ({layout.value}) must "
            f"match device_data: expected {(c, n, r)}, got {got} from shape "
            f"{tuple(host_data.shape)}"
        )
    if device_data.is_cuda:
        # Whether the memory is page-locked is checked by Triton's launcher (it asks the driver
        # for the device address); _launch turns its refusal into a ValueError.
        if host_data.device.type != "cpu" and host_data.device != device_data.device:
            raise ValueError(
                f"transfer_rows: host_data must be pinned CPU memory (HostKVPool with pin=True) "
                f"or on {device_data.device}, got {host_data.device}"
            )
    elif host_data.device != device_data.device:
        raise ValueError(
            f"transfer_rows: host_data must be on {device_data.device} like device_data, "
            f"got {host_data.device}"
        )


def _check_indices(
    device_data: torch.Tensor, host_indices: torch.Tensor, device_indices: torch.Tensor
) -> int:
    for name, index in (("host_indices", host_indices), ("device_indices", device_indices)):
        if not isinstance(index, torch.Tensor):
            raise ValueError(
                f"transfer_rows: {name} must be a torch.Tensor, got {type(index).__name__}"
            )
        if index.dtype not in INDEX_DTYPES:
            raise ValueError(f"transfer_rows: {name} must be int32 or int64, got {index.dtype}")
        if index.dim() != 1:
            raise ValueError(
                f"transfer_rows: {name} must be 1-D, got shape {tuple(index.shape)}"
            )
        if index.device != device_data.device:
            raise ValueError(
                f"transfer_rows: {name} must be on {device_data.device} (device_data's "
                f"device), got {index.device}"
            )
        if not index.is_contiguous():
            raise ValueError(f"transfer_rows: {name} must be contiguous, got a strided view")
    if host_indices.numel() != device_indices.numel():
        raise ValueError(
            f"transfer_rows: host_indices and device_indices must have the same length, got "
            f"{host_indices.numel()} and {device_indices.numel()}"
        )
    return int(host_indices.numel())


def _check_launch(
    num_layers: int,
    layer_begin: int,
    layer_end: int,
    num_programs: int,
    tokens_per_tile: int,
) -> None:
    if not 0 <= layer_begin <= layer_end <= num_layers:
        raise ValueError(
            f"transfer_rows: layer range [{layer_begin}, {layer_end}) must lie in "
            f"[0, {num_layers}] with begin <= end"
        )
    if num_programs < 1:
        raise ValueError(f"transfer_rows: num_programs must be >= 1, got {num_programs}")
    if not 1 <= tokens_per_tile <= MAX_TOKENS_PER_TILE or tokens_per_tile & (
        tokens_per_tile - 1
    ):
        raise ValueError(
            f"transfer_rows: tokens_per_tile must be a power of two in "
            f"[1, {MAX_TOKENS_PER_TILE}], got {tokens_per_tile}"
        )


def _strides(data: torch.Tensor, layout: HostLayout) -> tuple[int, ...]:
    """``(num_slots, page_size, page, slot, component, layer)`` of a pool buffer, strides in
    elements; ``page_size`` is 1 (slot ``s`` at ``s * page stride``) except for
    ``page_first_direct``."""
    if layout is HostLayout.LAYER_FIRST:
        return data.shape[2], 1, data.stride(2), data.stride(2), data.stride(0), data.stride(1)
    if layout is HostLayout.PAGE_FIRST:
        return data.shape[0], 1, data.stride(0), data.stride(0), data.stride(1), data.stride(2)
    pages, page_size = data.shape[0], data.shape[3]
    return (pages * page_size, page_size, data.stride(0), data.stride(3), data.stride(1),
            data.stride(2))


def _next_power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()


def _num_warps(block_bytes: int) -> int:
    """Enough threads that each moves about ``_BYTES_PER_THREAD`` of a block, 1 to 16 warps."""
    warps = max(1, min(16, block_bytes // (32 * _BYTES_PER_THREAD)))
    return _next_power_of_two(warps)
