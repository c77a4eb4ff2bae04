"""Page buffers: byte views of host-pool pages, and the checks every backend call runs on them.

A page of a ``page_first`` host pool is one contiguous run (``[page_size, components, layers,
row]``), so it is one segment; so is a page of a ``page_first_direct`` pool (``[components,
layers, page_size, row]``); a page of a ``layer_first`` pool is ``components x layers`` runs
of ``page_size`` rows, one segment each, in component-then-layer order. The views share
the pool's memory: a backend reads from and writes into the slots with no copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .keys import PAGE_HASH_BYTES, Namespace

if TYPE_CHECKING:
    from ..pools import HostKVPool, Indices


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte ``memoryview`` sharing a contiguous CPU tensor's memory."""
    if tensor.device.type != "cpu":
        raise ValueError(f"page buffers must be in host memory, got a tensor on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"page buffer tensors must be contiguous, got strides {tensor.stride()}")
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data


def host_page_views(pool: HostKVPool, host_indices: Indices) -> list[list[memoryview]]:
    """The segments of the pages at ``host_indices`` of ``pool``, one list per page.

    Args:
        pool: the host pool (pinned or not).
        host_indices: slot indices of whole pages, page after page, each page's slots
            consecutive from a multiple of ``page_size`` (as the host allocator hands them out).

    Raises:
        ValueError: indices not page aligned, or of another space (see ``HostKVPool.check``).
    """
    slots = pool.check(host_indices, "host_page_views").to(torch.int64)
    size = pool.page_size
    if slots.numel() % size:
        raise ValueError(f"host_page_views: {slots.numel()} slots is not a whole number of "
                         f"{size}-slot pages")
    rows = slots.view(-1, size)
    starts = rows[:, 0]
    if bool((starts % size != 0).any()) or not torch.equal(
            rows - starts[:, None], torch.arange(size).expand_as(rows)):
        raise ValueError(f"host_page_views: slots must form whole pages (runs of {size} "
                         f"consecutive slots from a multiple of {size})")
    data = pool.data
    views = []
    for start in starts.tolist():
        if pool.layout.value == "page_first":
            views.append([byte_view(data[start:start + size])])
        elif pool.layout.value == "page_first_direct":
            views.append([byte_view(data[start // size])])
        else:
            views.append([byte_view(data[c, layer, start:start + size])
                          for c in range(data.shape[0]) for layer in range(data.shape[1])])
    return views


def check_batch(op: str, namespace: Namespace, page_hashes: Sequence[bytes],
                pages: Sequence[Sequence[Any]] | None, *, writable: bool
                ) -> list[list[memoryview]]:
    """Validate one call's keys and buffers; return the buffers as byte memoryviews.

    Raises:
        ValueError: a key that is not a 32-byte page hash, a count mismatch, a page whose
            segments do not add up to ``namespace.page_bytes``, a read-only destination.
        TypeError: a segment that is not a buffer, or a tensor of another dtype.
    """
    for i, key in enumerate(page_hashes):
        if not isinstance(key, bytes) or len(key) != PAGE_HASH_BYTES:
            raise ValueError(f"{op}: page_hashes[{i}] must be {PAGE_HASH_BYTES} bytes from "
                             f"chain_page_hashes, got {key!r:.80}")
    if pages is None:
        return []
    if len(pages) != len(page_hashes):
        raise ValueError(f"{op}: {len(page_hashes)} page hashes but {len(pages)} page buffers; "
                         "give one buffer list per page")
    views = []
    for i, page in enumerate(pages):
        if isinstance(page, torch.Tensor | memoryview | bytes | bytearray | np.ndarray):
            raise TypeError(f"{op}: pages[{i}] must be a list of segments, got one "
                            f"{type(page).__name__}; wrap it as [buffer]")
        segments = [_segment(op, namespace, i, s, writable) for s in page]
        total = sum(s.nbytes for s in segments)
        if total != namespace.page_bytes:
            raise ValueError(f"{op}: pages[{i}] holds {total} bytes in {len(segments)} "
                             f"segment(s); pages of this namespace are {namespace.page_bytes} "
                             f"bytes {namespace.segment_bytes} (check page size and layout)")
        views.append(segments)
    return views


def _segment(op: str, namespace: Namespace, i: int, segment: Any, writable: bool
             ) -> memoryview:
    if isinstance(segment, torch.Tensor):
        dtype = str(segment.dtype).removeprefix("torch.")
        if dtype not in (namespace.dtype, "uint8"):
            raise TypeError(f"{op}: pages[{i}] has a {dtype} tensor; this namespace stores "
                            f"{namespace.dtype} (or pass uint8 bytes)")
        view = byte_view(segment)
    else:
        try:
            view = memoryview(segment)
        except TypeError:
            raise TypeError(f"{op}: pages[{i}] segments must be tensors or buffers, got "
                            f"{type(segment).__name__}") from None
        if not view.c_contiguous:
            raise ValueError(f"{op}: pages[{i}] has a non-contiguous segment")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if writable and view.readonly:
        raise ValueError(f"{op}: pages[{i}] has a read-only segment; get writes into it")
    return view
