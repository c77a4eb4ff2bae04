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
from .page_segments import PageRows, worth_one_copy

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


def host_page_views(pool: HostKVPool, host_indices: Indices) -> list[Sequence[memoryview]]:
    """The segments of the pages at ``host_indices`` of ``pool``, one sequence per page: a
    list of byte views, or for a ``layer_first`` page of 8 segments or more and 64 KiB or
    more a :class:`~hicache.storage.page_segments.PageRows` (its rows' view; a segment's
    byte view is made when asked for, and the stores move the page without them).

    Args:
        pool: the host pool (pinned or not).
        host_indices: slot indices of whole pages, page after page, each page's slots
            consecutive from a multiple of ``page_size`` (as the host allocator hands them out).

    Raises:
        ValueError: indices not page aligned, or of another space (see ``HostKVPool.check``).
    """
    slots = pool.check(host_indices, "host_page_views").to(torch.int64).numpy()
    size = pool.page_size
    if slots.size % size:
        raise ValueError(f"host_page_views: {slots.size} slots is not a whole number of "
                         f"{size}-slot pages")
    rows = slots.reshape(-1, size)
    starts = rows[:, 0]
    if bool((starts % size).any()) or not np.array_equal(rows - starts[:, None],
                                                         np.broadcast_to(_steps(size), rows.shape)):
        raise ValueError(f"host_page_views: slots must form whole pages (runs of {size} "
                         f"consecutive slots from a multiple of {size})")
    # One byte view of the whole buffer, sliced at offsets computed at once: a slice is a
    # tenth of a microsecond, where a tensor's indexing and view took several (a page of a
    # 32-layer layer_first pool is 64 segments, and this runs on a store worker's thread,
    # whose interpreter time the scheduler thread waits for).
    data = pool.data
    flat = byte_view(data)
    if pool.layout.value == "layer_first":
        components, layers, num_slots, _ = data.shape
        row_bytes = data[0, 0, 0].nbytes
        length = size * row_bytes
        runs = np.arange(components * layers, dtype=np.int64) * num_slots
        if not worth_one_copy(components * layers, components * layers * length):
            offsets = (runs[None, :] + starts[:, None]) * row_bytes
            return [[flat[o:o + length] for o in page] for page in offsets.tolist()]
        table = np.frombuffer(flat, dtype=np.uint8).reshape(components * layers, -1)
        return [PageRows(table[:, start:start + length])
                for start in (starts * row_bytes).tolist()]
    slot_bytes = flat.nbytes // pool.num_slots  # page_first and page_first_direct alike
    length = size * slot_bytes
    return [[flat[o:o + length]] for o in (starts * slot_bytes).tolist()]


def _steps(size: int) -> np.ndarray:
    return np.arange(size, dtype=np.int64)


def check_batch(op: str, namespace: Namespace, page_hashes: Sequence[bytes],
                pages: Sequence[Sequence[Any]] | None, *, writable: bool
                ) -> list[Sequence[memoryview]]:
    """Validate one call's keys and buffers; return the buffers as byte memoryviews (a
    :class:`~hicache.storage.page_segments.PageRows` as it is).

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
    views: list[Sequence[memoryview]] = []
    for i, page in enumerate(pages):
        if isinstance(page, torch.Tensor | memoryview | bytes | bytearray | np.ndarray):
            raise TypeError(f"{op}: pages[{i}] must be a list of segments, got one "
                            f"{type(page).__name__}; wrap it as [buffer]")
        total = _quick_total(page, writable)
        if total is not None:  # host_page_views' segments: nothing to convert
            segments = page if isinstance(page, list | PageRows) else list(page)
        else:
            segments = [_segment(op, namespace, i, s, writable) for s in page]
            total = sum(s.nbytes for s in segments)
        if total != namespace.page_bytes:
            raise ValueError(f"{op}: pages[{i}] holds {total} bytes in {len(segments)} "
                             f"segment(s); pages of this namespace are {namespace.page_bytes} "
                             f"bytes {namespace.segment_bytes} (check page size and layout)")
        views.append(segments)
    return views


def _quick_total(page: Sequence[Any], writable: bool) -> int | None:
    """The bytes of a page whose segments are all contiguous one-dimensional byte
    ``memoryview`` s (writable if asked): what :func:`_segment` would return for them, counted
    in a fraction of its time; ``None`` for any other page. A :class:`PageRows` is counted
    by its rows' view, which the stores move at once (:mod:`.page_segments`)."""
    total = 0
    if type(page) is PageRows:
        if writable and not page.rows.flags.writeable:
            return None
        total, page = int(page.rows.nbytes), page.extra
    for segment in page:
        if type(segment) is not memoryview or segment.format != "B" or segment.ndim != 1 \
                or not segment.c_contiguous or (writable and segment.readonly):
            return None
        total += len(segment)
    return total


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
