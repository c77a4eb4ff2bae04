"""Staging of one chunk for a ``page_first_direct`` host: where each pair's rows sit in the
device staging buffer, the device gather and scatter into it, and the copy-engine copies.

A ``page_first_direct`` host stores ``[pages, components, layers, page_size, row]``. The chunk's
host slots (sorted) split into pieces, each the consecutive slots of one page; a piece of
``length`` slots at chunk position ``position`` is staged as ``[components, moved layers,
length, row]`` at ``position * components * moved layers`` rows of the buffer, so a whole page
is staged exactly as the host stores it (for the moved layers) and the buffer holds no holes.
Consecutive whole pages form a segment ``[pages, components, layers, page_size, row]`` on both
sides: for one block of consecutive layers it is ``pages x components`` blocks of ``layers x
page_size`` rows, equally spaced on each side (a page apart on the host), which
:mod:`~hicache.controller.copy2d` moves as ONE 2D copy: for a layer-wise load of a
16-token page of 2 KiB rows, 32 KiB blocks, which the copy engine moves near the link's
ceiling; for a write of all layers, one contiguous run. A partial page (a chunk edge, a
fragment, a slot loaded twice in one merged op) is its own segment of one page.

When every piece is a whole page, the gather reads the device rows straight into the
page-major staging (one indexed read per block of layers, written through a permuted view)
and the scatter writes them back from it the same way; where the device slots are whole
device pages in order too (an allocation's: :func:`~.slot_segments.device_pages`), both
index pages, not slots (:meth:`DirectStaging.gather_device_pages`,
:meth:`DirectStaging.scatter_device_pages`).
Otherwise the gather reads them layer-major into a temporary ``[components, moved layers,
pairs, row]`` and places them with an index copy, and the scatter does the reverse. Both
run at HBM speed on the stream the caller makes current, which allocates and owns the
temporaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.pools.pinned_uploads import UPLOADS

from .slot_segments import Segment, page_pieces, page_segments


class PagePlan:
    """How a chunk's host slots (sorted; int64 numpy, repeats allowed) split into pieces of
    one page each and segments of whole pages, with slots of ``page_size`` per page. It does
    not depend on the layers moved: a layer-wise load makes it once per chunk of the op and
    every layer group's :class:`DirectStaging` reuses it.

    Args:
        segments: the chunk's segments when known (cut from the op's:
            :func:`hicache.controller.chunk_slots.segments_between`); else found here.
    """

    def __init__(self, host_slots: np.ndarray, page_size: int,
                 segments: list[Segment] | None = None) -> None:
        self.page_size = page_size
        self.num_pairs = int(host_slots.size)
        if segments is None:
            segments = page_segments(host_slots, *page_pieces(host_slots, page_size),
                                     page_size)
        self.segments = segments
        # a piece of a whole page's length is the whole page
        self.whole_pages = all(segment.length == page_size for segment in segments)

    def pieces(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)`` of the pieces, in pair positions (:func:`page_pieces`)."""
        segments = self.segments
        counts = np.array([segment.num_pages for segment in segments], dtype=np.int64)
        lengths = np.repeat(np.array([segment.length for segment in segments],
                                     dtype=np.int64), counts)
        firsts = np.repeat(np.array([segment.position for segment in segments],
                                    dtype=np.int64), counts)
        in_segment = np.arange(lengths.size) - np.repeat(np.cumsum(counts) - counts, counts)
        return firsts + in_segment * lengths, lengths


class DirectStaging:
    """The staging plan of one chunk (see the module docstring).

    Args:
        pages: the chunk's :class:`PagePlan`.
        num_components: K and V (2) or one latent row (1).
        num_layers: layers the chunk moves (the staging holds only those).
        row_elems: elements per row.
    """

    def __init__(self, pages: PagePlan, num_components: int, num_layers: int,
                 row_elems: int) -> None:
        self.page_size, self.row_elems = pages.page_size, row_elems
        self.shape = (num_components, num_layers)
        self.num_pairs = pages.num_pairs
        self.pages = pages
        self.whole_pages = pages.whole_pages
        self.segments = pages.segments
        self._target_rows: torch.Tensor | None = None

    def stage(self, gathered: torch.Tensor, rows: torch.Tensor) -> None:
        """Place ``gathered`` ``[components, layers, pairs, row]`` into the staging ``rows``
        ``[components * layers * pairs, row]`` (same dtype and device) for partial pages
        (whole pages are gathered in place: :meth:`gather_pages`)."""
        rows.index_copy_(0, self._targets(rows.device), gathered.reshape(-1, gathered.shape[-1]))

    def unstage(self, rows: torch.Tensor) -> torch.Tensor:
        """``[components, layers, pairs, row]`` of the staging ``rows`` for partial pages (a
        new tensor, made on the current stream; whole pages scatter from the staging in
        place: :meth:`scatter_pages`)."""
        assert not self.whole_pages, "whole pages scatter in place (scatter_pages)"
        c, n = self.shape
        return rows.index_select(0, self._targets(rows.device)).view(c, n, self.num_pairs,
                                                                   rows.shape[-1])

    def gather_pages(self, rows: torch.Tensor, index: torch.Tensor,
                     blocks: Sequence[tuple[int, int]], device_rows: Sequence[torch.Tensor]
                     ) -> None:
        """Device rows at ``index`` (a device slot per pair, whole pages) into the staging
        ``rows`` as ``[pages, C, layers, page_size, row]``: per block of layers (as
        :meth:`scatter_pages`), one indexed read written straight into a permuted view of
        the staging, with no layer-major temporary and no placing copy after it (which
        doubled the gather's passes over device memory, and the SM time a write takes
        from the model's compute)."""
        c, n = self.shape
        pages = self.num_pairs // self.page_size
        staged = rows.view(pages, c, n, self.page_size, rows.shape[-1])
        by_page = index.view(pages, self.page_size)
        for (offset, count), rows_of in zip(blocks, device_rows, strict=True):
            # [slots, C, count, row] read at [pages, page_size] -> [pages, page_size, C, count,
            # row], written through the staging's view in that order
            torch.ops.aten.index.Tensor_out(
                rows_of.permute(2, 0, 1, 3), [by_page],
                out=staged.narrow(2, offset, count).permute(0, 3, 1, 2, 4))

    def page_views(self, rows: torch.Tensor, blocks: Sequence[tuple[int, int]]
                   ) -> list[torch.Tensor]:
        """The staging ``rows`` of whole pages (``[pages, C, layers, page_size, row]``) as
        ``[C, count, pages, page_size, row]`` per block of layers (``(offset in the moved
        layers, count)``): what :meth:`gather_device_pages` writes and
        :meth:`scatter_device_pages` reads, made once per staging buffer and layer shape
        by the chunk's plan."""
        c, n = self.shape
        pages = self.num_pairs // self.page_size
        staged = rows.view(pages, c, n, self.page_size, rows.shape[-1]).permute(1, 2, 0, 3, 4)
        return [staged.narrow(1, offset, count) for offset, count in blocks]

    def gather_device_pages(self, staged_pages: Sequence[torch.Tensor], page_index: torch.Tensor,
                            paged_rows: Sequence[torch.Tensor]) -> None:
        """:meth:`gather_pages` from device slots that are whole device pages in order:
        per block of layers, one ``index_select`` of whole pages (``page_index``) from its
        device rows viewed as ``[C, count, slots / page_size, page_size, row]``
        (``paged_rows``) into the staging's page views (:meth:`page_views`; as
        :meth:`scatter_device_pages`, the other way). Against an indexed read
        (``aten.index``) into the same views, on an H200, one layer of 32k tokens in
        16-token pages took 77 against 98 us on the GPU (the SM time a write takes from the
        model's compute) and 11 against 13 us of CPU, 32 layers of 1024 tokens 94 against
        111 and 24 against 35 us (one run of a script; bit-identical)."""
        for out, rows_of in zip(staged_pages, paged_rows, strict=True):
            torch.index_select(rows_of, 2, page_index, out=out)

    def scatter_pages(self, rows: torch.Tensor, index: torch.Tensor,
                      blocks: Sequence[tuple[int, int]], device_rows: Sequence[torch.Tensor]
                      ) -> None:
        """The staging ``rows`` of whole pages (``[pages, C, layers, page_size, row]``)
        into device rows at ``index`` (a device slot per pair): per block of layers
        (``(offset in the moved layers, count)``, its device rows ``[C, count, slots,
        row]``), one indexed store that reads the staging in place through a permuted
        view, with no layer-major copy of the chunk on the device first (:meth:`unstage`,
        for partial pages)."""
        c, n = self.shape
        pages = self.num_pairs // self.page_size
        staged = rows.view(pages, c, n, self.page_size, rows.shape[-1]).permute(1, 2, 0, 3, 4)
        by_page = index.view(pages, self.page_size)
        for (offset, count), rows_of in zip(blocks, device_rows, strict=True):
            rows_of[:, :, by_page] = staged.narrow(1, offset, count)

    def scatter_device_pages(self, staged_pages: Sequence[torch.Tensor], page_index: torch.Tensor,
                             paged_rows: Sequence[torch.Tensor]) -> None:
        """:meth:`scatter_pages` into device slots that are whole device pages in order
        (:func:`device_pages`): per block of layers, one index copy of whole pages
        (``page_index``: the device page of each staged page) from the staging's page views
        (:meth:`page_views`) into its device rows viewed as ``[C, count, slots /
        page_size, page_size, row]`` (``paged_rows``). An index entry moves a page's
        ``page_size`` rows, where the slot store indexes every row: for one layer of 32k
        tokens in 16-token pages on an H200, 17-28 against 29-34 us of CPU to issue and
        84-86 against 105-107 us on the GPU (two runs of a script)."""
        for staged, rows_of in zip(staged_pages, paged_rows, strict=True):
            rows_of.index_copy_(2, page_index, staged)

    def segment_views(self, host: torch.Tensor, rows: torch.Tensor, block_offset: int,
                      begin: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(host view, staged view)`` of every segment for the block of consecutive layers
        ``begin .. end - 1`` of the host buffer ``[pages, C, L, page_size, R]``, staged at
        ``block_offset`` of the moved layers in ``rows`` ``[C * layers * pairs, R]``: one
        2D copy each (:mod:`.copy2d`)."""
        c, n = self.shape
        views = []
        for seg in self.segments:
            first = seg.position * c * n
            staged = rows[first: first + seg.num_pages * seg.length * c * n].view(
                seg.num_pages, c, n, seg.length, self.row_elems)
            host_view = host[seg.page: seg.page + seg.num_pages, :, begin:end,
                             seg.offset: seg.offset + seg.length]
            views.append((host_view, staged[:, :, block_offset: block_offset + end - begin]))
        return views

    def _targets(self, device: torch.device) -> torch.Tensor:
        """Staging row of every (component, layer, pair) in ``[C, L, pairs]`` order, flat:
        a pair at ``q`` of a piece staged at ``p`` rows of ``length`` sits at row
        ``p + (component * layers + layer) * length + q``. Made once per plan and held with
        it by the op until it is acknowledged. The upload is asynchronous, on the current
        stream: a plan belongs to one op, whose stage (a write's gather, on its auxiliary
        stream) or unstage (a load's scatter, on the load stream) always runs on the same
        stream, so its uses are ordered after the upload. (A blocking upload of pageable
        memory waited for every copy queued on that stream: 14 ms of a 32k-token load's
        issue, measured.)"""
        if self._target_rows is not None:
            return self._target_rows
        c, n = self.shape
        starts, piece_lengths = self.pages.pieces()
        lengths = np.repeat(piece_lengths, piece_lengths)
        piece_starts = np.repeat(starts, piece_lengths)
        base = piece_starts * c * n + (np.arange(self.num_pairs) - piece_starts)
        grid = np.arange(c * n)[:, None] * lengths[None, :] + base[None, :]
        if device.type == "cuda":  # pinned, so the copy does not wait for the stream
            self._target_rows = UPLOADS.upload((grid.reshape(-1),), device)
        else:
            self._target_rows = torch.from_numpy(grid.reshape(-1))
        return self._target_rows
