"""The Triton kernel behind :func:`hicache.controller.kernel.transfer_rows`: its body, compiled
on first use, and whether it can run on this machine.

The body copies ``[TILE, ROW]`` blocks of rows in a grid-stride loop over (tile, layer,
component) work items; :mod:`hicache.controller.kernel` checks the arguments and plans the
launch. Triton is imported on first use, so importing this module never needs it. On a machine
without CUDA the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1`` set before
Triton is imported), which is how the CPU tests exercise it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from hicache.pools import PADDING_SLOT

INTERPRET_ENV = "TRITON_INTERPRET"

# Bound on first use by compiled_kernel(); the kernel body resolves ``tl`` from here.
tl: Any = None


def kernel_available() -> bool:
    """True when :func:`~hicache.controller.kernel.transfer_rows` can run here: Triton
    imports and either CUDA is available or ``TRITON_INTERPRET=1`` (CPU interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or interpreting()


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton runs kernels on the CPU, in its interpreter."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"


@functools.cache
def compiled_kernel() -> Any:
    """Import Triton and wrap the kernel (interpreted when ``TRITON_INTERPRET=1``)."""
    global tl
    try:
        import triton
        import triton.language as language
    except ImportError as exc:
        raise RuntimeError(
            "transfer_rows needs Triton (pip install 'hicache[kernel]'); use the torch "
            "backend on this machine"
        ) from exc
    if not torch.cuda.is_available() and not interpreting():
        raise RuntimeError(
            f"transfer_rows on CPU needs the Triton interpreter: set {INTERPRET_ENV}=1 before "
            f"Triton is imported, or use the torch backend"
        )
    tl = language
    return triton.jit(_copy_rows_kernel)


# Runtime arguments carry no annotations on purpose: Triton reads annotations as kernel types,
# and unannotated integers are specialised by value (int32 or int64, divisibility by 16).
def _copy_rows_kernel(  # type: ignore[no-untyped-def]
    src_ptr, dst_ptr, src_index_ptr, dst_index_ptr,
    num_pairs, num_src_slots, num_dst_slots,
    layer_begin, num_layers, num_components,
    src_page_size, src_page_stride, src_slot_stride, src_component_stride, src_layer_stride,
    dst_page_size, dst_page_stride, dst_slot_stride, dst_component_stride, dst_layer_stride,
    counters_ptr,
    ROW: tl.constexpr, BLOCK_ROW: tl.constexpr, TILE: tl.constexpr, COUNT: tl.constexpr,
):
    """Grid-stride loop over (tile, layer, component) items; one [TILE, ROW] block each.

    With ``COUNT`` the items go layer by layer (component, then tile, then layer) and each
    adds 1 to ``counters_ptr[layer]`` once its block is stored (every thread's stores, then a
    release at GPU scope): a layer's counter has grown by ``tiles * components`` when all of
    its rows are in place, which a stream waiting on that value observes
    (:mod:`hicache.controller.layer_counters`). Without it ``counters_ptr`` is never read.

    Slot ``s`` of a side starts at ``(s // page_size) * page_stride + (s % page_size) *
    slot_stride`` plus its component and layer offsets: ``page_size`` is 1 (a value Triton
    specialises, so the division folds away) except for a ``page_first_direct`` host, whose
    pages hold each layer's rows together."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    num_tiles = tl.cdiv(num_pairs, TILE)
    num_items = num_tiles * num_layers * num_components
    tokens = tl.arange(0, TILE)
    cols = tl.arange(0, BLOCK_ROW)
    col_mask = cols < ROW
    for item in range(pid, num_items, step):
        component = (item % num_components).to(tl.int64)
        rest = item // num_components
        if COUNT:
            layer = (layer_begin + rest // num_tiles).to(tl.int64)
            pairs = (rest % num_tiles) * TILE + tokens
        else:
            layer = (layer_begin + rest % num_layers).to(tl.int64)
            pairs = (rest // num_layers) * TILE + tokens
        in_range = pairs < num_pairs
        src_slot = tl.load(src_index_ptr + pairs, mask=in_range, other=0).to(tl.int64)
        dst_slot = tl.load(dst_index_ptr + pairs, mask=in_range, other=0).to(tl.int64)
        valid = in_range & (src_slot > 0) & (src_slot < num_src_slots)
        valid = valid & (dst_slot > 0) & (dst_slot < num_dst_slots)
        src_row = component * src_component_stride + layer * src_layer_stride
        dst_row = component * dst_component_stride + layer * dst_layer_stride
        src_rows = (src_row + (src_slot // src_page_size) * src_page_stride
                    + (src_slot % src_page_size) * src_slot_stride)
        dst_rows = (dst_row + (dst_slot // dst_page_size) * dst_page_stride
                    + (dst_slot % dst_page_size) * dst_slot_stride)
        mask = valid[:, None] & col_mask[None, :]
        rows = tl.load(src_ptr + src_rows[:, None] + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst_rows[:, None] + cols[None, :], rows, mask=mask)
        if COUNT:
            tl.debug_barrier()  # the block's stores by every thread, before the release
            tl.atomic_add(counters_ptr + layer, 1, sem="release", scope="gpu")


assert PADDING_SLOT == 0, "the kernel skips slot 0 (index > 0 test); update it with the sentinel"
