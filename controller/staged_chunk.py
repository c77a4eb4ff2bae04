"""A staged move's plans and chunks: what one op derives once and reuses for every layer
group (:class:`StagedMove`), and the data movement of one chunk (:func:`move_chunk`: device
gather/scatter through a staging buffer, one copy-engine copy per contiguous host run, on the
streams :class:`~hicache.controller.staged.StagedBackend` gives it).

A chunk's copies depend on its host slots and how many layers move in which blocks, not on
which layers: every layer of the host, and of the staging buffer, is laid out alike. A chunk
is planned once per op and layer shape (:class:`ChunkPlan`) as byte offsets from the host
and staging buffers, each run's copies shifted from a template planned once per run shape
(:mod:`~hicache.controller.chunk_copies`), its runs or pages cut from the op's
(:mod:`~hicache.controller.chunk_slots`); each layer group issues those copies with one
pointer addition per block of layers.

On a CPU pool (no streams, no copy engine) the same plans run as strided CPU copies
(:func:`~hicache.controller.copy2d.emulate_copies`): chunks and plans are tested on a CPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import copy2d
from .base import MovedTransfer
from .chunk_copies import CopyTemplates, run_copies, segment_copies
from .chunk_pages import move_pages
from .chunk_slots import ChunkSlots, OpSlots, device_page_index
from .direct_staging import DirectStaging
from .events import Event
from .layer_blocks import BlockShape
from .page_kernel import index_fits
from .staged_views import LayerGroup, PoolViews, StagingBuffer

if TYPE_CHECKING:
    from .staged import _Lane


class StagedMove:
    """What the staged backend derives once per op and pool transfer (``moved.staged_move``,
    held until the op is acknowledged): the side stream that issues it (an op is issued on
    one stream), the views of its pool pair (:class:`~.staged_views.PoolViews`, shared by
    every op between the two pools; made for this move alone when none is given), the
    device page of every host page's pairs when they are whole device pages (``page_index``:
    :func:`~.chunk_slots.device_page_index`; moved by :mod:`.chunk_pages`), each
    chunk's :class:`ChunkSlots` and each chunk's :class:`ChunkPlan` per layer shape."""

    def __init__(self, moved: MovedTransfer, side: torch.cuda.Stream | None,
                 views: PoolViews | None = None) -> None:
        self.side = side  # holds nothing that refers back to ``moved``: no cycle to collect
        if views is None:
            views = PoolViews(moved.source.host_pool, moved.source.device_pool)
        self.views, self.geometry = views, views.geometry
        # the host buffer, read off the pool (a closed pool raises here): never cached
        self.host = moved.source.host_pool.data
        self.token_major, self.rows = views.token_major, views.rows
        self.num_pairs = int(moved.host_index.numel())
        self.page_size = views.page_size
        self.page_index = device_page_index(moved)
        # where the page copy kernel reads the page ids (None: it cannot read them)
        self.page_index_ptr = (self.page_index.data_ptr() if self.page_index is not None
                               and index_fits(self.page_index) else None)
        self._slots: dict[tuple[int, int], ChunkSlots] = {}
        self._op_slots: OpSlots | None = None  # the whole op's runs or pages, found once
        self._plans: dict[tuple[int, BlockShape], list[ChunkPlan]] = {}
        self.lane: _Lane | None = None  # the staging lane its first copy found

    def chunks(self, moved: MovedTransfer, chunk_tokens: int, shape: BlockShape,
               buffer: StagingBuffer, templates: CopyTemplates) -> list[ChunkPlan]:
        """The plans of every chunk of ``chunk_tokens`` pairs of ``moved`` (this move's) for
        layers in ``shape``, made on first use, with 2D copies relative to the staging
        ``buffer`` (either buffer of a lane: they are laid out alike) from ``templates``."""
        plans = self._plans.get((chunk_tokens, shape))
        if plans is None:
            plans = self._plans[(chunk_tokens, shape)] = [
                ChunkPlan(self, self.slots(moved, start, min(start + chunk_tokens,
                                                             self.num_pairs)),
                          shape, buffer, templates)
                for start in range(0, self.num_pairs, chunk_tokens)]
        return plans

    def slots(self, moved: MovedTransfer, start: int, end: int) -> ChunkSlots:
        """The :class:`ChunkSlots` of pairs ``[start, end)``, shared by every layer shape."""
        slots = self._slots.get((start, end))
        if slots is None:
            op_slots = self._op_slots
            if op_slots is None:
                op_slots = self._op_slots = OpSlots(moved)
            slots = self._slots[(start, end)] = ChunkSlots(moved, start, end, op_slots)
        return slots


class ChunkPlan:
    """One chunk of an op for one layer shape: its device index, staging shape and 2D copies
    (one list per block of layers; ``None`` on a GPU without a runtime library for them).

    Staging follows the host layout so that every host run is one 2D copy: token-major
    ``[n, components, layers, row]`` for a ``page_first`` host, layer-major
    ``[components, layers, n, row]`` for a ``layer_first`` host, page by page for a
    ``page_first_direct`` host (:class:`~hicache.controller.direct_staging.DirectStaging`).
    """

    def __init__(self, move: StagedMove, slots: ChunkSlots, shape: BlockShape,
                 buffer: StagingBuffer, templates: CopyTemplates) -> None:
        self.slots = slots
        # whole device pages (see StagedMove): the op's page ids and this chunk's span
        self.page_span: tuple[torch.Tensor, int, int] | None = None
        self.kernel_pages: int | None = None  # the span's address, for the page kernel
        self.host, self.token_major = move.host, move.token_major  # not ``move``: no cycle
        geometry = move.geometry
        c, r, layers = geometry.num_components, geometry.row_elems, sum(n for _, n in shape)
        n = len(slots.host_slots)
        self.direct: DirectStaging | None = None
        self.page_size = move.page_size
        if slots.pages is not None:
            self.direct = DirectStaging(slots.pages, c, layers, r)
            self.shape: tuple[int, ...] = (n * c * layers, r)
        else:
            self.shape = (n, c, layers, r) if move.token_major else (c, layers, n, r)
        page = self.page_size  # chunks start at whole host pages (chunk_tokens)
        if (move.page_index is not None and not move.token_major and not n % page
                and (self.direct is None or self.direct.whole_pages)):
            first = slots.start // page
            self.page_span = (move.page_index, first, slots.end // page)
            if move.page_index_ptr is not None:  # int64 ids: 8 bytes each
                self.kernel_pages = move.page_index_ptr + 8 * first
        self.numel = n * c * layers * r
        self.wide_shape = (*self.shape[:-1], move.rows.shape[-1])
        self.wide = move.rows.dtype
        self.copies: list[list[copy2d.Copy2D]] | None = None
        if not buffer.data.is_cuda or copy2d.have_2d_copies():
            staged = self.staged(buffer)  # host layer 0: a group adds its layers' offset
            if slots.pages is not None:
                self.copies = [segment_copies(templates, self.host, staged,
                                              slots.pages.segments, c, layers, offset, count)
                               for offset, count in shape]
            else:
                self.copies = [run_copies(templates, self.host, staged, self.token_major,
                                          slots.runs, slots.host_slots, offset, count)
                               for offset, count in shape]

    @property
    def page_index(self) -> torch.Tensor | None:
        """The device page of each of the chunk's host pages (a slice of the op's page
        ids, made when asked: the kernel reads them by address), or ``None``."""
        span = self.page_span
        return None if span is None else span[0][span[1]: span[2]]

    def staged(self, buffer: StagingBuffer) -> torch.Tensor:
        """This chunk's staging view of ``buffer`` in the pool's dtype."""
        return buffer.view(self.numel, buffer.data.dtype, self.shape)

    def rows(self, buffer: StagingBuffer) -> torch.Tensor:
        """This chunk's staging view of ``buffer`` as wide rows (the device rows'
        elements)."""
        return buffer.view(self.numel, self.wide, self.wide_shape)

    def views(self, staged: torch.Tensor, block_offset: int, begin: int, end: int
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(host view, staged view)`` of every host run for host layers ``begin .. end - 1``
        staged at ``block_offset`` of the moved layers."""
        host, count = self.host, end - begin
        if self.direct is not None:
            return self.direct.segment_views(host, staged, block_offset, begin, end)
        views = []
        for offset, length in self.slots.runs:
            first = int(self.slots.host_slots[offset])
            if self.token_major:
                views.append((host[first: first + length, :, begin:end],
                              staged[offset: offset + length, :, block_offset:
                                     block_offset + count]))
            else:
                views.append((host[:, begin:end, first: first + length],
                              staged[:, block_offset: block_offset + count,
                                     offset: offset + length]))
        return views


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
