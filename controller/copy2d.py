"""Strided host<->device block copies as single copy-engine operations (``cudaMemcpy2DAsync``).

A staged move copies, per contiguous host run, a block that is strided on one or both sides:
all layers and components of a run in a ``layer_first`` host (rows ``len * row`` bytes long,
one per component and layer, a host slot count apart), or one layer of each token of a run in
a ``page_first`` host (rows of one layer, a token's bytes apart). torch's ``copy_`` cannot
move a strided pinned block in one operation (it copies row by row from Python, or makes the
host side contiguous on the CPU first), so this module describes both views as
``height`` rows of ``width`` bytes with a pitch each (:func:`plan_rows`) and issues one
``cudaMemcpy2DAsync`` for the pair on the current stream.

The runtime library is the one torch already loaded (found by name in this process's mapped
files); where it is not found, or a pitch exceeds what a 2D copy takes, the block moves row
by row with ``copy_`` (slower, same bytes). On a CPU device pool there is no copy engine and
the block is copied with ``copy_`` directly.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
from typing import NamedTuple

import torch

from .cuda_libraries import cuda_runtime

logger = logging.getLogger(__name__)

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addresses
MAX_PITCH_BYTES = 2**31 - 1  # cudaDevAttrMaxPitch on current GPUs; larger pitches go row-wise


class RowPlan(NamedTuple):
    """A strided view as ``height`` rows of ``width_bytes``, ``pitch_bytes`` apart."""

    ptr: int
    pitch_bytes: int
    width_bytes: int
    height: int


def plan_rows(dst: torch.Tensor, src: torch.Tensor) -> tuple[RowPlan, RowPlan] | None:
    """Describe two views of one shape as equal rows: the longest trailing block contiguous in
    both, repeated over leading dimensions that collapse to one stride on each side.

    Returns ``None`` when the leading dimensions do not collapse (the caller splits the block
    along its first dimension and plans the parts).

    Raises:
        ValueError: the views differ in shape or dtype, or a last dimension is strided.
    """
    _check_views(dst, src)
    return _plan(dst, src)


def _plan(dst: torch.Tensor, src: torch.Tensor) -> tuple[RowPlan, RowPlan] | None:
    shape, dst_strides, src_strides = dst.shape, dst.stride(), src.stride()
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    width, split = 1, len(dims)
    while split > 0:
        d = dims[split - 1]
        if dst_strides[d] != width or src_strides[d] != width:
            break
        width *= shape[d]
        split -= 1
    leading = dims[:split]
    pitches = []
    for strides in (dst_strides, src_strides):
        for outer, inner in itertools.pairwise(leading):
            if strides[outer] != strides[inner] * shape[inner]:
                return None
        pitches.append(strides[leading[-1]] if leading else width)
    height = 1
    for d in leading:
        height *= shape[d]
    size = dst.element_size()
    return (
        RowPlan(dst.data_ptr(), pitches[0] * size, width * size, height),
        RowPlan(src.data_ptr(), pitches[1] * size, width * size, height),
    )


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype; one on a CUDA device, the other pinned
    host memory, both views with a contiguous last dimension) on the current stream,
    asynchronously: as few copy-engine operations as the views allow.

    The caller keeps both tensors' memory alive until the stream has passed the copy.

    Raises:
        ValueError: the views differ in shape or dtype, or a last dimension is strided.
        RuntimeError: the CUDA runtime refused the copy (its error is in the message).
    """
    _check_views(dst, src)
    if not dst.is_cuda and not src.is_cuda:
        dst.copy_(src)
        return
    if _cudart() is None:
        _copy_rows(dst, src)
        return
    stream = torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).cuda_stream
    # ``dst`` in the host's place and ``to_host``: each copy runs from ``src`` to ``dst``.
    issue_copies(plan_copies(dst, src, 0, 0), 0, 0, True, stream)


def plan_block(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[RowPlan, RowPlan]]:
    """The 2D copies (destination plan first) that together move ``src`` into ``dst``: one
    where the views collapse to equal rows (:func:`plan_rows`), else one per part along the
    first dimension, recursively; every pitch is one a 2D copy takes.

    Raises:
        ValueError: the views differ in shape or dtype, or a last dimension is strided.
    """
    _check_views(dst, src)
    return _plan_parts(dst, src)


# One planned copy relative to two base pointers: (host offset, host pitch, staged offset,
# staged pitch, width, height), all in bytes but the height.
Copy2D = tuple[int, int, int, int, int, int]


def plan_copies(host: torch.Tensor, staged: torch.Tensor, host_base: int,
                staged_base: int) -> list[Copy2D]:
    """:func:`plan_block` of two views of one shape, as offsets from the pointers
    ``host_base`` and ``staged_base``: the same copies move any other pair of views that sit
    at the same offsets from other bases (another layer of the host, the other staging
    buffer), so a staged move plans a chunk once and issues it for every layer group."""
    return [(h.ptr - host_base, h.pitch_bytes, s.ptr - staged_base, s.pitch_bytes,
             h.width_bytes, h.height) for h, s in plan_block(host, staged)]


class CopyPlanner:
    """:func:`plan_copies` from fixed bases, planning each pair of view shapes and strides
    once: views that differ only in where they start have :func:`shifted` copies."""

    def __init__(self, host_base: int, staged_base: int) -> None:
        self.host_base, self.staged_base = host_base, staged_base
        self._known: dict[tuple[object, ...], list[Copy2D]] = {}

    def plan(self, host: torch.Tensor, staged: torch.Tensor) -> list[Copy2D]:
        """The copies between ``host`` and ``staged`` (views of one shape and dtype)."""
        host_ptr, staged_ptr = host.data_ptr(), staged.data_ptr()
        key = (host.shape, host.stride(), host.dtype, staged.shape, staged.stride(),
               staged.dtype)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = plan_copies(host, staged, host_ptr, staged_ptr)
        return shifted(known, host_ptr - self.host_base, staged_ptr - self.staged_base)


def shifted(copies: list[Copy2D], host_shift: int, staged_shift: int) -> list[Copy2D]:
    """``copies`` moved by ``host_shift`` and ``staged_shift`` bytes on their two sides."""
    return [(host + host_shift, host_pitch, staged + staged_shift, staged_pitch, width, height)
            for host, host_pitch, staged, staged_pitch, width, height in copies]


def issue_copies(copies: list[Copy2D], host_ptr: int, staged_ptr: int, to_host: bool,
                 stream: int) -> None:
    """Issue ``copies`` (:func:`plan_copies`) between pinned host memory at ``host_ptr`` and
    device memory at ``staged_ptr`` on the CUDA stream handle ``stream``, asynchronously.
    The caller keeps both memories alive until the stream has passed the copies.

    Raises:
        RuntimeError: no CUDA runtime library, or the runtime refused a copy.
    """
    library = _cudart()
    if library is None:
        raise RuntimeError("issue_copies: no CUDA runtime library for 2D copies; check "
                           "have_2d_copies() and copy views with copy_block instead")
    memcpy = library.cudaMemcpy2DAsync  # plain ints: its argtypes convert them
    for host, host_pitch, staged, staged_pitch, width, height in copies:
        if to_host:
            status = memcpy(host_ptr + host, host_pitch, staged_ptr + staged, staged_pitch,
                            width, height, CUDA_MEMCPY_DEFAULT, stream)
        else:
            status = memcpy(staged_ptr + staged, staged_pitch, host_ptr + host, host_pitch,
                            width, height, CUDA_MEMCPY_DEFAULT, stream)
        if status != 0:
            _refused(library, status, height, width)


def emulate_copies(copies: list[Copy2D], host_bytes: torch.Tensor, host_offset: int,
                   staged_bytes: torch.Tensor, to_host: bool) -> None:
    """:func:`issue_copies` on a CPU, for tests of the plans: ``host_bytes`` and
    ``staged_bytes`` are flat ``uint8`` views of the two buffers (:func:`as_bytes`), the
    host's offsets counted from ``host_offset``."""
    host_start = host_bytes.storage_offset() + host_offset
    staged_start = staged_bytes.storage_offset()
    for offset, host_pitch, staged_offset, staged_pitch, width, height in copies:
        host_rows = host_bytes.as_strided((height, width), (host_pitch, 1),
                                          host_start + offset)
        staged_rows = staged_bytes.as_strided((height, width), (staged_pitch, 1),
                                              staged_start + staged_offset)
        if to_host:
            host_rows.copy_(staged_rows)
        else:
            staged_rows.copy_(host_rows)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor`` as a flat ``uint8`` view (for :func:`emulate_copies`)."""
    assert tensor.is_contiguous(), "emulated 2D copies index contiguous tensors"
    return tensor.view(-1).view(torch.uint8)


def _plan_parts(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[RowPlan, RowPlan]]:
    plan = _plan(dst, src)
    if plan is not None and plan[0].height == 1:  # one row: its pitch is never used
        return [(plan[0]._replace(pitch_bytes=plan[0].width_bytes),
                 plan[1]._replace(pitch_bytes=plan[1].width_bytes))]
    if plan is not None and _fits(plan):
        return [plan]
    return [part for part_dst, part_src in zip(dst.unbind(0), src.unbind(0), strict=True)
            for part in _plan_parts(part_dst, part_src)]


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Without a runtime library: ``copy_`` of the largest parts that are single rows."""
    plan = _plan(dst, src)
    if dst.dim() == 0 or (plan is not None and plan[0].height == 1):
        dst.copy_(src, non_blocking=True)
        return
    for part_dst, part_src in zip(dst.unbind(0), src.unbind(0), strict=True):
        _copy_rows(part_dst, part_src)


def _refused(library: ctypes.CDLL, status: int, height: int, width: int) -> None:
    raise RuntimeError(
        f"cudaMemcpy2DAsync failed with error {status} ({_error_name(library, status)}) "
        f"copying {height} rows of {width} bytes; the host pool must be "
        f"pinned (HostKVPool with pin=True)")


def have_2d_copies() -> bool:
    """Whether strided blocks move as single 2D copies here (a CUDA runtime was found)."""
    return _cudart() is not None


def _check_views(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"block copy: views must have one shape and dtype, got {tuple(dst.shape)} "
            f"{dst.dtype} and {tuple(src.shape)} {src.dtype}; slice both sides alike")
    if dst.dim() and (dst.stride(-1) != 1 or src.stride(-1) != 1):
        raise ValueError("block copy: the last dimension of both views must be contiguous "
                         "(stride 1); take views of whole rows")


def _fits(plan: tuple[RowPlan, RowPlan]) -> bool:
    return all(p.pitch_bytes <= MAX_PITCH_BYTES for p in plan)


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch uses, with ``cudaMemcpy2DAsync`` typed; ``None`` when
    CUDA is unavailable or no runtime library can be opened."""
    if not torch.cuda.is_available():
        return None
    library = cuda_runtime()
    if library is None:
        logger.warning("no CUDA runtime library found for 2D copies; strided staged copies "
                       "go row by row (slower)")
        return None
    function = library.cudaMemcpy2DAsync
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return library


def _error_name(library: ctypes.CDLL, status: int) -> str:
    try:
        function = library.cudaGetErrorString
        function.restype = ctypes.c_char_p
        function.argtypes = [ctypes.c_int]
        text = function(status)
        return text.decode() if text else "unknown"
    except AttributeError:
        return "unknown"
