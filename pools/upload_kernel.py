"""Index uploads that do not queue behind a load: a Triton kernel reads the pinned host
buffer through unified addressing and writes the device tensor.

Why not ``tensor.to(device, non_blocking=True)``: a copy from pinned memory larger than a
few KiB is carried by the host-to-device copy engine, which takes copies in the order they
were issued, from every stream. While a staged (or direct, or torch) load has its copies
queued, such an upload waits for all of them, whatever stream it is on. Measured on an H200
while a 32k-token staged load (4 GiB, 32 copies) was in flight: a 64 KiB or 256 KiB pinned
copy issued on the caller's stream finished with the load, 78 ms later; one of 16 KiB or
less (which the driver carries inline) and this kernel's 256 KiB finished at once. A write
issued after a load waited on its own index upload that way, so the two directions never
overlapped, and a forward's slots uploaded during a layer-wise load would stall the forward
until the whole load was in.

Uploads of at most :data:`INLINE_BYTES` keep the plain copy (cheaper to issue). The kernel
runs on the current stream, so the ordering of the copy it replaces is kept. Triton is
imported on first use; without it the plain copy runs (and the stall above can happen).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from .triton_jit import jit_or_none

INLINE_BYTES = 16 << 10  # the largest upload measured not to wait for queued copies
BLOCK = 1024

tl: Any = None  # bound on first use (jit_or_none); the kernel body resolves it from here
logger = logging.getLogger(__name__)
_failed: list[str] = []  # why the kernel failed once; then every upload takes the copy


def upload_through_sms(source: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``source`` (1-D int64, pinned host memory; CPU memory in the interpreter) copied to
    a new tensor on ``device`` by the kernel, on the current stream; ``None`` when the copy
    should go through the copy engine instead: an upload of at most :data:`INLINE_BYTES`,
    or no kernel here (no Triton, or no CUDA outside the interpreter, or a launch that
    failed once: Triton that cannot compile for this GPU is logged and the copy used from
    then on)."""
    count = source.numel()
    if count * source.element_size() <= INLINE_BYTES or not kernel_upload_available(device):
        return None
    target = torch.empty(count, dtype=torch.int64, device=device)
    try:
        _compiled()[(-(-count // BLOCK),)](source, target, count, BLOCK=BLOCK)
    except Exception as error:  # a compiler or driver Triton cannot use: the copy still works
        _failed.append(f"{type(error).__name__}: {error}")
        logger.warning("index uploads: the upload kernel failed (%s); uploads go through the "
                       "copy engine from now on, and wait for a load's queued copies",
                       _failed[0])
        return None
    return target


def kernel_upload_available(device: torch.device) -> bool:
    """True when :func:`upload_through_sms` can launch its kernel for ``device``."""
    if _failed or (device.type != "cuda"
                   and os.environ.get("TRITON_INTERPRET", "0") != "1"):
        return False
    return _compiled() is not None


@functools.cache
def _compiled() -> Any:
    return jit_or_none(_upload_kernel)


# Runtime arguments carry no annotations on purpose: Triton reads annotations as kernel types.
def _upload_kernel(source_ptr, target_ptr, n,  # type: ignore[no-untyped-def]
                   BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(target_ptr + offsets, tl.load(source_ptr + offsets, mask=mask), mask=mask)
