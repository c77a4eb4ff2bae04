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
from pathlib import Path
from typing import NamedTuple

import torch

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
    dims = [d for d in range(dst.dim()) if dst.shape[d] != 1]
    width, split = 1, len(dims)
    while split > 0:
        d = dims[split - 1]
        if dst.stride(d) != width or src.stride(d) != width:
            break
        width *= dst.shape[d]
        split -= 1
    leading = dims[:split]
    pitches = []
    for view in (dst, src):
        for outer, inner in itertools.pairwise(leading):
            if view.stride(outer) != view.stride(inner) * view.shape[inner]:
                return None
        pitches.append(view.stride(leading[-1]) if leading else width)
    height = 1
    for d in leading:
        height *= dst.shape[d]
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
    library = _cudart()
    plan = _plan(dst, src)
    if plan is None or library is None or not _fits(plan):
        if dst.dim() == 0 or (plan is not None and plan[0].height == 1):
            dst.copy_(src, non_blocking=True)
            return
        for part_dst, part_src in zip(dst.unbind(0), src.unbind(0), strict=True):
            copy_block(part_dst, part_src)
        return
    target, source = plan
    stream = torch.cuda.current_stream(dst.device if dst.is_cuda else src.device)
    status = library.cudaMemcpy2DAsync(
        ctypes.c_void_p(target.ptr), ctypes.c_size_t(target.pitch_bytes),
        ctypes.c_void_p(source.ptr), ctypes.c_size_t(source.pitch_bytes),
        ctypes.c_size_t(target.width_bytes), ctypes.c_size_t(target.height),
        ctypes.c_int(CUDA_MEMCPY_DEFAULT), ctypes.c_void_p(stream.cuda_stream),
    )
    if status != 0:
        raise RuntimeError(
            f"cudaMemcpy2DAsync failed with error {status} ({_error_name(library, status)}) "
            f"copying {target.height} rows of {target.width_bytes} bytes; the host pool must be "
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
    torch.cuda.init()
    for name in [*_mapped_runtimes(), "libcudart.so", "libcudart.so.13", "libcudart.so.12"]:
        try:
            library = ctypes.CDLL(name)
            function = library.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        logger.debug("2D copies through %s", name)
        return library
    logger.warning("no CUDA runtime library found for 2D copies; strided staged copies go "
                   "row by row (slower)")
    return None


def _mapped_runtimes() -> list[str]:
    """Paths of ``libcudart`` files mapped into this process (the one torch loaded)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    found: list[str] = []
    for line in maps.read_text().splitlines():
        path = line.split()[-1] if line.split() else ""
        if "libcudart" in Path(path).name and path not in found:
            found.append(path)
    return found


def _error_name(library: ctypes.CDLL, status: int) -> str:
    try:
        function = library.cudaGetErrorString
        function.restype = ctypes.c_char_p
        function.argtypes = [ctypes.c_int]
        text = function(status)
        return text.decode() if text else "unknown"
    except AttributeError:
        return "unknown"
