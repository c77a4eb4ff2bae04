"""The data movement of one staged chunk (:func:`move_chunk`): device gather or scatter
through a staging buffer and one copy-engine copy per contiguous host run, on the streams
:class:`~hicache.controller.staged.StagedBackend` gives it, by the chunk's
:class:`~hicache.controller.staged_chunk.ChunkPlan`. On a CPU pool (no streams, no copy
engine) the same plans run as strided CPU copies (:func:`~.copy2d.emulate_copies`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import copy2d
from .chunk_pages import move_pages
from .events import Event
from .page_kernel import PageLaunch, launch_pages
from .staged_views import LayerGroup, StagingBuffer

if TYPE_CHECKING:
    from .staged_chunk import ChunkPlan


def move_chunk(plan: ChunkPlan, group: LayerGroup, to_host: bool, buffer: StagingBuffer,
               side: torch.cuda.Stream | None, aux: torch.cuda.Stream | None,
               copier: torch.cuda.Stream | None, free: Event, staged: Event,
               previous: Event | None) -> None:
    """Move one chunk through the staging ``buffer``, whose two events are reused chunk after
    chunk: ``free`` (recorded once the buffer may be overwritten; this chunk waits on its
    previous record, a no-op before the first) and ``staged`` (recorded once the buffer is
    filled or drained; the other leg waits on it at once). A wait takes the record made
    before it: recording again after the wait was issued is safe; no event is made per chunk.

    The copy-engine copy runs on ``copier`` (the buffer's own copy stream), after
    ``previous`` when given: the event recorded after the copy before it (see
    :mod:`~hicache.controller.copy_turns`: the copy engine then holds one chunk of the op at
    a time, and another stream's copy gets it between two chunks).

    Write: gather on ``aux``, copy on ``copier``, ``free`` recorded there. Load: copy on
    ``copier`` (``staged`` recorded there), scatter on the side stream, so the side stream
    (whose events say "layer ready") never holds back the next layer's copy. Copies and
    events name their stream; the kernels run on the current stream, which the caller makes
    ``aux`` for a write's chunks (its gathers and temporaries), the side stream for a load's.
    """
    if not to_host:
        free.wait(copier)
        if previous is not None:
            previous.wait(copier)
        _copy(plan, group, buffer, False, copier)
        staged.record(copier)
        staged.wait(side)
        _scatter(plan, group, buffer)
        free.record(side)
        return
    free.wait(aux)
    _gather(plan, group, buffer)
    staged.record(aux)
    staged.wait(copier)
    if previous is not None:
        previous.wait(copier)
    _copy(plan, group, buffer, True, copier)
    free.record(copier)


def move_paged_chunk(plan: ChunkPlan, group: LayerGroup, launches: list[PageLaunch],
                     buffer: StagingBuffer, copier: torch.cuda.Stream, done: Event,
                     previous: Event | None, drained: Event | None) -> None:
    """:func:`move_chunk` of a load's chunk whose device side the page kernel scatters
    (``launches``: :func:`~.chunk_pages.kernel_launches`), all of it on ``copier``, the
    buffer's own copy stream: the copy, then the scatter. The buffer then needs no event:
    what last used it ran earlier on that stream (``drained``: the event of a scatter that
    ran on the side stream instead, which the copy waits on first). ``done`` is recorded
    after the copy (the next chunk's turn, ``previous``, waits on it, as in
    :func:`move_chunk`): two event calls a chunk where :func:`move_chunk` makes five.

    The caller has made ``copier`` wait on the side stream once for the op (the scatter
    writes the op's device rows after its start) and, after the chunks of a layer group,
    makes the side stream wait on the copy streams that scattered them."""
    pages = plan.kernel_pages
    assert pages is not None, "kernel_launches found the chunk's page ids"
    if drained is not None:
        drained.wait(copier)
    if previous is not None:
        previous.wait(copier)
    _copy(plan, group, buffer, False, copier)
    done.record(copier)
    launch_pages(launches, pages, copier.cuda_stream)


def _copy(plan: ChunkPlan, group: LayerGroup, buffer: StagingBuffer, to_host: bool,
          stream: torch.cuda.Stream | None) -> None:
    """The chunk's host runs between the host and ``buffer`` on ``stream``."""
    if plan.copies is None:  # a GPU without a runtime library for 2D copies: row by row
        staged = plan.staged(buffer)
        with torch.cuda.stream(stream):
            for (offset, count), begin in zip(group.shape, group.begins, strict=True):
                for host_view, staged_view in plan.views(staged, offset, begin, begin + count):
                    if to_host:
                        copy2d.copy_block(host_view, staged_view)
                    else:
                        copy2d.copy_block(staged_view, host_view)
        return
    if stream is None:
        staged, host = copy2d.as_bytes(buffer.data), copy2d.as_bytes(plan.host)
        for copies, host_offset in zip(plan.copies, group.host_offsets, strict=True):
            copy2d.emulate_copies(copies, host, host_offset, staged, to_host)
        return
    handle, base = stream.cuda_stream, buffer.data.data_ptr()
    for copies, host_ptr in zip(plan.copies, group.host_ptrs, strict=True):
        copy2d.issue_copies(copies, host_ptr, base, to_host, handle)


def _gather(plan: ChunkPlan, group: LayerGroup, buffer: StagingBuffer) -> None:
    """Device rows of the chunk into its staging rows (wide) in ``buffer``."""
    if move_pages(plan, group, buffer, scatter=False):  # whole pages from whole pages
        return
    direct = plan.direct
    index, rows = plan.slots.device_index, plan.rows(buffer)
    if direct is not None and direct.whole_pages:  # into the page-major staging in place
        direct.gather_pages(rows, index, group.shape, group.device_rows)
    elif direct is not None:
        gathered = torch.empty((*direct.shape, index.numel(), rows.shape[-1]),
                               dtype=rows.dtype, device=rows.device)
        _select(group, index, gathered, 2, 1)
        direct.stage(gathered, rows)
    elif group.views.token_major:
        _select(group, index, rows, 0, 2)
    else:
        _select(group, index, rows, 2, 1)


def _select(group: LayerGroup, index: torch.Tensor, out: torch.Tensor, dim: int,
            layer_dim: int) -> None:
    """``out`` (layers along ``layer_dim``) = the device rows of ``index`` along ``dim``."""
    if len(group.device_rows) == 1:
        torch.index_select(group.device_rows[0], dim, index, out=out)
        return
    for (offset, count), device_rows in zip(group.shape, group.device_rows, strict=True):
        out.narrow(layer_dim, offset, count).copy_(torch.index_select(device_rows, dim, index))


def _scatter(plan: ChunkPlan, group: LayerGroup, buffer: StagingBuffer) -> None:
    """The chunk's staging rows (wide) in ``buffer`` into the device rows."""
    if move_pages(plan, group, buffer, scatter=True):  # whole pages to whole pages
        return
    direct = plan.direct
    dim, layer_dim = (0, 2) if group.views.token_major else (2, 1)
    index, rows = plan.slots.device_index, plan.rows(buffer)
    if direct is not None and direct.whole_pages:  # from the page-major staging in place
        return direct.scatter_pages(rows, index, group.shape, group.device_rows)
    if direct is not None:
        rows = direct.unstage(rows)  # layer-major, as for a layer_first host
    if len(group.device_rows) == 1:
        group.device_rows[0].index_copy_(dim, index, rows)
        return
    for (offset, count), device_rows in zip(group.shape, group.device_rows, strict=True):
        device_rows.index_copy_(dim, index, rows.narrow(layer_dim, offset, count))
