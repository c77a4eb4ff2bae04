"""A prepared kernel copy of one pool pair's rows, launched once per layer range.

A layer-wise load launches the row kernel once per layer group with the same buffers and
index tensors; :class:`RowCopy` checks those once and keeps the launch arguments (measured
on an H100 host: about 100 us of Python per launch through
:func:`~hicache.controller.kernel.transfer_rows`, which checks and records every argument
on every call). On a GPU its launches go through
:func:`~hicache.controller.kernel_launch.fast_launch`, which specialises the fixed
arguments once per copy and calls the compiled kernel's launcher, so a launch costs that
launcher and little else.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import torch

from hicache.pools import HostLayout

from .copy_rows_kernel import compiled_kernel
from .kernel_launch import fast_launch
from .layer_counters import check_counters

INDEX_DTYPES = (torch.int32, torch.int64)
MAX_TOKENS_PER_TILE = 1024
_INT32_LIMIT = 2**31 - 1
# Bytes one thread moves per item when picking num_warps: 8 vectors of 16 bytes.
_BYTES_PER_THREAD = 128


class RowCopy:
    """Rows of ``host_indices`` / ``device_indices`` between two pool buffers, one direction
    (arguments and checks as :func:`~hicache.controller.kernel.transfer_rows`, which is a
    ``RowCopy`` launched once).

    Stream contract: :meth:`launch` runs on the current CUDA stream and does not record the
    index tensors on it; the caller keeps them alive until that stream has run the launches
    (the controller's ops record their moved indices on the side stream and hold them).

    Raises:
        ValueError: a malformed argument, as ``transfer_rows`` raises.
    """

    def __init__(self, *, device_data: torch.Tensor, host_data: torch.Tensor,
                 host_layout: HostLayout, host_indices: torch.Tensor,
                 device_indices: torch.Tensor, to_host: bool, num_programs: int = 16,
                 tokens_per_tile: int = 8) -> None:
        self.to_host = to_host
        self._plan = plan = _buffer_plan(device_data, host_data, host_layout)
        self.num_pairs = _check_indices(device_data, host_indices, device_indices)
        self.num_layers = plan.num_layers
        check_launch(plan.num_layers, 0, 0, num_programs, tokens_per_tile)
        self._num_programs, self._tile = num_programs, tokens_per_tile
        self._num_tiles = -(-self.num_pairs // tokens_per_tile)
        self._host_data = host_data
        device_side = (device_data, device_indices, *plan.device_strides)
        host_side = (host_data, host_indices, *plan.host_strides)
        src, dst = (device_side, host_side) if to_host else (host_side, device_side)
        self._head = (src[0], dst[0], src[1], dst[1], self.num_pairs, src[2], dst[2])
        self._tail = (plan.num_components, *src[3:], *dst[3:])
        warps = _num_warps(tokens_per_tile * plan.block_row_bytes)
        self._device = device_data.device if plan.on_cuda else None
        # per COUNT (False, True): the constexprs in signature order, the launch options, the
        # fast launch's key (found on launch; kernel_launch), the entry point's keywords
        self._constexprs = tuple((plan.row_elems, plan.block_row, tokens_per_tile, count)
                                 for count in (False, True))
        self._options = tuple((*constexprs, warps) for constexprs in self._constexprs)
        self._meta = tuple({"ROW": plan.row_elems, "BLOCK_ROW": plan.block_row,
                            "TILE": tokens_per_tile, "COUNT": count, "num_warps": warps}
                           for count in (False, True))
        self._fixed: list[tuple[object, ...] | None] = [None, None]
        self._no_counters = _no_counters(device_data.device)

    @property
    def items_per_layer(self) -> int:  # what a counted launch adds to each layer's counter
        return self._num_tiles * self._plan.num_components

    def launch(self, layer_begin: int, layer_end: int,
               counters: torch.Tensor | None = None) -> None:
        """Copy local layers ``[layer_begin, layer_end)``; nothing for an empty range or no
        pairs. With ``counters`` (int32, one per local layer, on the pools' device) the
        layers go in order and each layer's counter grows by :attr:`items_per_layer` as its
        rows land. ``ValueError`` for a range outside the pool's layers, or host memory the
        GPU cannot address (not pinned)."""
        plan = self._plan
        if not 0 <= layer_begin <= layer_end <= plan.num_layers:
            check_launch(plan.num_layers, layer_begin, layer_end, self._num_programs,
                          self._tile)
        num_layers = layer_end - layer_begin
        if self.num_pairs == 0 or num_layers == 0:
            return
        num_items = self._num_tiles * num_layers * plan.num_components
        if num_items > _INT32_LIMIT:
            raise ValueError(
                f"transfer_rows: {num_items} work items exceed the int32 loop bound; split the "
                f"transfer or raise tokens_per_tile (got {self._tile})"
            )
        grid = (min(self._num_programs, num_items),)
        device = self._device
        on_device: contextlib.AbstractContextManager[Any] = (
            torch.cuda.device(device) if device is not None
            and torch.cuda.current_device() != device.index else contextlib.nullcontext())
        count = counters is not None and check_counters(counters, self._no_counters, layer_end)
        tail = (*self._tail, counters if count else self._no_counters)
        try:
            with on_device:
                if device is None:  # the CPU interpreter
                    compiled_kernel()[grid](*self._head, layer_begin, num_layers, *tail,
                                            **self._meta[count])
                else:
                    fast = fast_launch()
                    fixed = self._fixed[count]
                    if fixed is None:
                        fixed = self._fixed[count] = fast.fixed_key(
                            device.index or 0, self._head + tail, self._options[count])
                    fast.launch(fixed, (grid[0], 1, 1), self._head, layer_begin, num_layers,
                                tail, self._constexprs[count], self._meta[count])
        except ValueError as exc:
            if "cannot be accessed" not in str(exc):
                raise
            host = self._host_data
            raise ValueError(
                f"transfer_rows: the GPU cannot address host_data ({host.device}, "
                f"{tuple(host.shape)}): it must be pinned, e.g. a HostKVPool with pin=True "
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


@functools.cache
def _no_counters(device: torch.device) -> torch.Tensor:
    """The counters argument of an uncounted launch on ``device``: an int32 tensor like real
    counters (so both launches specialise alike), never read."""
    return torch.zeros(1, dtype=torch.int32, device=device)


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


def check_launch(
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
