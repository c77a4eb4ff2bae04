"""One Triton launch for a deferred bounds check on CUDA (see :mod:`hicache.pools.bounds`).

The kernel reads the indices once, writes the cleaned copy (offenders replaced by the padding
index 0) and stores the check's record ``(min(0, min excess), max(0, max excess))`` straight
into the pinned host row the CPU reads, through unified addressing: no memcpy, no extra
launch. One program walks the whole tensor, which is small where checks run (a forward's
locations, a decode batch's page table); a larger one goes to the torch path.

Triton is imported on first use; without it (or for a CPU tensor outside the interpreter)
:func:`kernel_check_available` is false and the torch path runs.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from .triton_jit import jit_or_none

MAX_ELEMENTS = 1 << 16
BLOCK = 1024

tl: Any = None  # bound on first use (jit_or_none); the kernel body resolves it from here


def kernel_check_available(tensor: torch.Tensor) -> bool:
    """True when :func:`check_with_kernel` can run on ``tensor`` here."""
    if tensor.numel() > MAX_ELEMENTS:
        return False
    if tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    return _compiled() is not None


def check_with_kernel(values: torch.Tensor, bound: int, record: torch.Tensor) -> torch.Tensor:
    """Clean ``values`` against ``[0, bound)`` and write the record, in one launch.

    Args:
        values: int32/int64 indices, any shape, at most ``MAX_ELEMENTS``.
        bound: one past the largest valid value.
        record: ``[2]`` int64, pinned host memory (or CPU memory in the interpreter).
    Returns:
        int64 tensor of ``values``' shape, offenders replaced by 0.
    """
    flat = values.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    safe = torch.empty(flat.shape, dtype=torch.int64, device=flat.device)
    _compiled()[(1,)](flat, safe, record, flat.numel(), bound, BLOCK=BLOCK)
    return safe.view(values.shape)


@functools.cache
def _compiled() -> Any:
    return jit_or_none(_bounds_kernel)


# Runtime arguments carry no annotations on purpose: Triton reads annotations as kernel types.
def _bounds_kernel(values_ptr, safe_ptr, record_ptr, n, bound,  # type: ignore[no-untyped-def]
                   BLOCK: tl.constexpr):
    low = tl.zeros([BLOCK], dtype=tl.int64)
    high = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n
        value = tl.load(values_ptr + offsets, mask=mask, other=0).to(tl.int64)
        excess = value - tl.minimum(tl.maximum(value, 0), bound - 1)
        tl.store(safe_ptr + offsets, tl.where(excess == 0, value, 0), mask=mask)
        low = tl.minimum(low, excess)
        high = tl.maximum(high, excess)
    tl.store(record_ptr, tl.min(low, axis=0))
    tl.store(record_ptr + 1, tl.max(high, axis=0))
