"""A staged op's host slots as its chunks see them: runs of consecutive slots (a
``layer_first`` or ``page_first`` host) or segments of whole pages and partial pages (a
``page_first_direct`` host), found once for the whole op (:class:`OpSlots`) and cut per chunk
(:class:`ChunkSlots`) with two binary searches. Finding them anew per chunk scanned every
slot of the op once per chunking: a 32k-token layer-wise load chunks its pairs several ways
(one per layer-group size), and the scans took about 1 ms of the issue of a
``page_first_direct`` load on an H100 host (measured)."""

from __future__ import annotations

import numpy as np
import torch

from hicache.pools import HostLayout
from hicache.pools.pinned_uploads import UPLOADS

from .base import MovedTransfer
from .direct_staging import PagePlan
from .slot_segments import (
    Segment,
    device_pages,
    page_pieces,
    page_run_segments,
    page_segments,
    whole_pages,
)


def host_runs(host_slots: np.ndarray) -> list[tuple[int, int]]:
    """Split sorted host slots into ``(start position, length)`` runs of consecutive slots."""
    return runs_between(run_breaks(host_slots), 0, host_slots.size)


def run_breaks(host_slots: np.ndarray) -> np.ndarray:
    """Positions where a run of consecutive ``host_slots`` begins, the first excepted."""
    return (host_slots[1:] - host_slots[:-1] != 1).nonzero()[0] + 1


def runs_between(breaks: np.ndarray, start: int, end: int) -> list[tuple[int, int]]:
    """:func:`host_runs` of positions ``[start, end)`` (counted from ``start``) of slots
    whose :func:`run_breaks` are ``breaks``: found once an op, cut per chunk."""
    if end <= start:
        return []
    inner = breaks[breaks.searchsorted(start, "right"): breaks.searchsorted(end, "left")]
    firsts = [0, *(inner - start).tolist()]
    lasts = [*firsts[1:], end - start]
    return [(first, last - first) for first, last in zip(firsts, lasts, strict=True)]


def segments_between(segments: list[Segment], positions: np.ndarray, start: int, end: int
                     ) -> list[Segment]:
    """The segments (:func:`~hicache.controller.slot_segments.page_segments`) of positions
    ``[start, end)`` (counted from ``start``) of slots whose segments are ``segments``, which
    start at ``positions``: a segment cut by either end keeps its part inside, as a partial
    page, whole pages, and a partial page."""
    if end <= start:
        return []
    first = int(positions.searchsorted(start, "right")) - 1
    last = int(positions.searchsorted(end, "left"))
    if last - first == 1:
        return _cut(segments[first], start, end, start)
    head, tail = segments[first], segments[last - 1]
    return [*_cut(head, start, head.position + head.num_pages * head.length, start),
            *(segment._replace(position=segment.position - start)
              for segment in segments[first + 1: last - 1]),
            *_cut(tail, tail.position, end, start)]


def _cut(segment: Segment, low: int, high: int, base: int) -> list[Segment]:
    """Positions ``[low, high)`` (inside ``segment``) of ``segment``, counted from
    ``base``."""
    length, begin = segment.length, low - segment.position
    stop = high - segment.position
    first_page, last_page = begin // length, (stop - 1) // length
    if first_page == last_page:
        return [Segment(low - base, segment.page + first_page,
                        segment.offset + begin - first_page * length, 1, stop - begin)]
    cut = []
    whole_first, whole_last = first_page, last_page
    if begin % length:
        cut.append(Segment(low - base, segment.page + first_page,
                           segment.offset + begin % length, 1, length - begin % length))
        whole_first += 1
    if stop % length:
        whole_last -= 1
    if whole_first <= whole_last:
        cut.append(Segment(segment.position + whole_first * length - base,
                           segment.page + whole_first, segment.offset,
                           whole_last - whole_first + 1, length))
    if stop % length:
        cut.append(Segment(segment.position + last_page * length - base,
                           segment.page + last_page, segment.offset, 1, stop % length))
    return cut


class OpSlots:
    """The run breaks (:func:`run_breaks`) of all of an op's host slots, or on a
    ``page_first_direct`` host their segments (and the position each starts at). An op
    whose checks found its host pages (whole pages, in order: :func:`known_host_pages`)
    finds them from its pages, one id a page, not from its slots. The chunks of an op of one
    run (no break; one segment of whole pages, ``run_page``) are cut by arithmetic."""

    def __init__(self, moved: MovedTransfer) -> None:
        host = moved.source.host_pool
        slots = moved.host_index.numpy()
        self.page_size = host.page_size
        self._device_index = moved.device_index  # the op's (a tensor: no cycle)
        # a move of whole pages keeps its device slots on the CPU (move_whole_pages)
        device = moved.source.device_pool.device
        self._upload_to = device if (device.type == "cuda"
                                     and not moved.device_index.is_cuda) else None
        self.host_slots = slots
        self.breaks: np.ndarray | None = None
        self.segments: list[Segment] | None = None
        self.positions = np.zeros(0, dtype=np.int64)
        # on a ``page_first_direct`` host, the first page when the op's slots are one run
        # of whole pages (an allocation's, the common case): its chunks are cut by
        # arithmetic, as the chunks of an op without run breaks on the other layouts
        self.run_page: int | None = None
        known = known_host_pages(moved)
        if host.layout is HostLayout.PAGE_FIRST_DIRECT:
            pages = known if known is not None else whole_pages(slots, host.page_size)
            if pages is not None:  # the common case: an op of whole host pages
                self.segments, self.positions = page_run_segments(pages, host.page_size)
                if len(self.segments) == 1:
                    self.run_page = self.segments[0].page
                return
            self.segments = page_segments(slots, *page_pieces(slots, host.page_size),
                                          host.page_size)
            self.positions = np.array([segment.position for segment in self.segments],
                                      dtype=np.int64)
            return
        if known is not None:  # slots run on within a page; between pages, where ids do
            self.breaks = (np.flatnonzero(known[1:] != known[:-1] + 1) + 1) * host.page_size
        else:
            self.breaks = run_breaks(slots)

    def device_index(self) -> torch.Tensor:
        """The op's device slots where the chunks' kernels read them. Where the op kept them
        on the CPU (it moves whole pages), they are uploaded the first time a chunk needs
        them (one that cannot move whole pages), on the current stream: the stream of the
        kernels that read them, after the op's start (the op's side or auxiliary stream,
        the same for all its chunks); once for the op."""
        if self._upload_to is not None:
            self._device_index = UPLOADS.upload((self._device_index.numpy(),),
                                                self._upload_to)
            self._upload_to = None
        return self._device_index


def known_host_pages(moved: MovedTransfer) -> np.ndarray | None:
    """The host page of every ``page_size`` pairs of ``moved`` when its checks found them
    and the move kept its pairs as they are (:func:`~.index_moves.move_whole_pages`
    handed the pages over), host pages of the host pool's size; else ``None``."""
    known = moved.pages
    if (known is None or moved.device_page_index is None
            or known.host_page_size != moved.source.host_pool.page_size):
        return None
    return known.host_pages


def device_page_index(moved: MovedTransfer) -> torch.Tensor | None:
    """The device page of every ``page_size`` pairs of ``moved`` (int64, beside its device
    index) when each such group is one device page's slots in order
    (:func:`~hicache.controller.slot_segments.device_pages`), else ``None``: uploaded with
    the device index where the op's checks found them (any layout but ``page_first``),
    else found here for a ``page_first_direct`` host.

    The slots are checked on the CPU, in the op's own index tensors, when the move kept
    their order (its host index is the op's own tensor: no padding pair was dropped and
    ``order_pairs`` found them sorted; otherwise ``None``); the pages are then read off
    the device index where it is, on the device with one kernel on the current stream
    (the side stream's, which reads them). The device index itself is uploaded with the
    host's by ``move_indices`` on the caller's stream, as for every backend: an upload of
    its own inside the op (on the side or the auxiliary stream) made a host hit of 8k
    tokens 3 points slower end to end (measured). An op whose checks found its pages
    (:func:`~.index_moves.move_whole_pages`) has them uploaded with its device index, in
    the same copy: no check and no kernel."""
    if moved.device_page_index is not None:  # uploaded with the device index
        return moved.device_page_index
    source = moved.source
    host = source.host_pool
    if (host.layout is not HostLayout.PAGE_FIRST_DIRECT
            or moved.host_index is not source.host_indices.tensor
            or device_pages(source.device_indices.tensor.numpy(), host.page_size,
                            source.device_pool.num_slots) is None):
        return None
    return moved.device_index[::host.page_size] // host.page_size


class ChunkSlots:
    """Pairs ``[start, end)`` of ``moved``: their device index, host slots and what the copies
    derive from the host slots (runs of consecutive slots, or the pages of a
    ``page_first_direct`` host), cut from the op's :class:`OpSlots`. None of it depends on
    the layers moved."""

    def __init__(self, moved: MovedTransfer, start: int, end: int, op: OpSlots) -> None:
        self.start, self.end = start, end
        self._op = op
        self._device_index: torch.Tensor | None = None
        self.host_slots = op.host_slots[start:end]
        self.pages: PagePlan | None = None
        self.runs: list[tuple[int, int]] = []
        page_size = op.page_size
        if op.segments is None:
            breaks = op.breaks
            assert breaks is not None, "an op's slots have breaks or segments"
            self.runs = runs_between(breaks, start, end) if breaks.size else [(0, end - start)]
        elif op.run_page is not None and not start % page_size and not end % page_size:
            # one run of whole pages: the chunk's pages follow from its start
            self.pages = PagePlan(self.host_slots, page_size, [Segment(
                0, op.run_page + start // page_size, 0, (end - start) // page_size, page_size)])
        else:
            self.pages = PagePlan(self.host_slots, page_size,
                                  segments_between(op.segments, op.positions, start, end))

    @property
    def device_index(self) -> torch.Tensor:
        """The pairs' device slots (a slice of the op's device index, made on first use:
        a chunk of whole device pages reads their page ids instead; see
        :meth:`OpSlots.device_index`)."""
        index = self._device_index
        if index is None:
            index = self._device_index = self._op.device_index()[self.start: self.end]
        return index
