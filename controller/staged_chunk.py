"""A staged move's plans: what one op derives once and reuses for every layer group
(:class:`StagedMove`), and the plan of each chunk (:class:`ChunkPlan`); the chunk's data
movement by its plan is :func:`~hicache.controller.chunk_moves.move_chunk`.

A chunk's copies depend on its host slots and how many layers move in which blocks, not on
which layers: every layer of the host, and of the staging buffer, is laid out alike. A chunk
is planned once per op and layer shape (:class:`ChunkPlan`) as byte offsets from the host
and staging buffers, each run's copies shifted from a template planned once per run shape
(:mod:`~hicache.controller.chunk_copies`), its runs or pages cut from the op's
(:mod:`~hicache.controller.chunk_slots`); each layer group issues those copies with one
pointer addition per block of layers. In an op whose host slots are one run (an
allocation's, the common case) every chunk of one length is the first one's, shifted by the
host bytes between them (:meth:`ChunkPlan.of_run`): a 32k-token write is 32 chunks of one
length, and planning each alone took about a third of its issue (measured). The first plans
are kept for later ops between the same pools (``PoolViews.plan_fields``): a small
layer-wise load is one chunk per layer group, each group of another layer count, and
planning them anew took about 20 us a group on an H200 host (measured), a quarter of a
256-token load's issue.

On a CPU pool (no streams, no copy engine) the same plans run as strided CPU copies
(:func:`~hicache.controller.copy2d.emulate_copies`): chunks and plans are tested on a CPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hicache.pools import HostLayout

from . import copy2d
from .base import MovedTransfer
from .chunk_copies import CopyTemplates, run_copies, segment_copies
from .chunk_slots import ChunkSlots, OpSlots, device_page_index
from .copy2d import shifted
from .direct_staging import DirectStaging
from .layer_blocks import BlockShape
from .page_kernel import index_fits
from .staged_views import PoolViews, StagingBuffer

if TYPE_CHECKING:
    from .staged import _Lane

# A plan's fields that belong to its op (ChunkPlan.fields leaves them out); the plans kept
# from earlier ops (PoolViews.plan_fields), at most this many, the oldest dropped first
_OP_FIELDS = ("slots", "host", "page_span", "kernel_pages", "direct")
MAX_KEPT_PLANS = 64
PlanFields = dict[str, Any]


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
        # bytes between two host slots a page (a ``page_first_direct`` host) or a slot apart
        size = self.host.element_size()
        self._by_page = moved.source.host_pool.layout is HostLayout.PAGE_FIRST_DIRECT
        self._slot_bytes = self.host.stride(
            0 if self._by_page or self.token_major else 2) * size
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
        # the lane's copy streams wait on the side stream's op start (move_paged_chunk)
        self.copiers_follow = False

    def chunks(self, moved: MovedTransfer, chunk_tokens: int, shape: BlockShape,
               buffer: StagingBuffer, templates: CopyTemplates) -> list[ChunkPlan]:
        """The plans of every chunk of ``chunk_tokens`` pairs of ``moved`` (this move's) for
        layers in ``shape``, made on first use, with 2D copies relative to the staging
        ``buffer`` (either buffer of a lane: they are laid out alike) from ``templates``."""
        plans = self._plans.get((chunk_tokens, shape))
        if plans is None:
            plans = self._plans[(chunk_tokens, shape)] = []
            first_of_length: dict[int, PlanFields] = {}  # in an op of one host run
            kept = self.views.plan_fields  # from earlier ops between the same pools
            for start in range(0, self.num_pairs, chunk_tokens):
                end = min(start + chunk_tokens, self.num_pairs)
                slots = self.slots(moved, start, end)
                first = first_of_length.get(end - start)
                if first is None and self._one_run(start, end):
                    key = (end - start, shape, self.page_index is not None,
                           self.page_index_ptr is not None)
                    first = kept.get(key)
                    if first is None:
                        plan = ChunkPlan(self, slots, shape, buffer, templates)
                        first = first_of_length[end - start] = kept[key] = plan.fields()
                        if len(kept) > MAX_KEPT_PLANS:
                            kept.pop(next(iter(kept)))
                        plans.append(plan)
                        continue
                    first_of_length[end - start] = first
                if first is not None:
                    plans.append(ChunkPlan.of_run(first, self, slots))
                    continue
                plans.append(ChunkPlan(self, slots, shape, buffer, templates))
        return plans

    def _one_run(self, start: int, end: int) -> bool:
        """Whether pairs ``[start, end)`` are part of one run of the op's host slots, as
        every chunk of their length (:meth:`ChunkPlan.of_run`): an op without run breaks, or
        of one run of whole pages on a ``page_first_direct`` host cut at whole pages."""
        op = self._op_slots
        assert op is not None, "slots() found the op's first"
        if op.segments is None:
            return op.breaks is not None and not op.breaks.size
        page = self.page_size
        return op.run_page is not None and not start % page and not end % page

    def host_bytes(self, slot: int) -> int:
        """Bytes from the host buffer's start to host slot ``slot`` (of layer 0, component 0;
        on a ``page_first_direct`` host, the first slot of a page)."""
        return (slot // self.page_size if self._by_page else slot) * self._slot_bytes

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
        self.first_host_bytes = move.host_bytes(int(slots.host_slots[0]))  # for of_run
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

    def fields(self) -> PlanFields:
        """What :meth:`of_run` needs of this plan, which must be the first chunk of its
        length and layer shape in one run of its op's host slots (:meth:`StagedMove._one_run`)
        for another such chunk, of this op or a later one between the same pools: none of
        the op's own (not the host buffer, whose pool may close, nor the slots or page ids)."""
        fields = {name: value for name, value in self.__dict__.items()
                  if name not in _OP_FIELDS}
        fields["direct"] = None if self.direct is None else (
            self.direct.shape, self.direct.row_elems)
        fields["page_span"] = self.page_span is not None
        return fields

    @classmethod
    def of_run(cls, fields: PlanFields, move: StagedMove, slots: ChunkSlots) -> ChunkPlan:
        """The plan of a chunk of ``move`` whose length and layer shape are those of the
        plan ``fields`` came from (:meth:`fields`), both in one run of their op's host slots
        (:meth:`StagedMove._one_run`): that plan's shapes and staging views, its copies
        shifted by the host bytes between the two chunks' first slots, its own slots,
        pages and page ids. What a plan made afresh would be."""
        plan = cls.__new__(cls)
        plan.__dict__.update(fields)
        plan.slots, plan.host, plan.page_span, plan.kernel_pages = slots, move.host, None, None
        direct = fields["direct"]
        if direct is not None:
            assert slots.pages is not None, "a page_first_direct chunk has pages"
            (components, layers), row_elems = direct
            plan.direct = DirectStaging(slots.pages, components, layers, row_elems)
        if fields["page_span"]:
            assert move.page_index is not None, "a chunk of whole pages has page ids"
            page = slots.start // plan.page_size
            plan.page_span = (move.page_index, page, slots.end // plan.page_size)
            if move.page_index_ptr is not None:
                plan.kernel_pages = move.page_index_ptr + 8 * page
        if plan.copies is not None:
            first = move.host_bytes(int(slots.host_slots[0]))
            plan.copies = [shifted(copies, first - plan.first_host_bytes, 0)
                           for copies in plan.copies]
            plan.first_host_bytes = first
        return plan

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
