"""How an op's host slots split by page, for a ``page_first_direct`` host: pieces (the
consecutive slots of one page each), segments (runs of consecutive whole pages; a partial
page alone) and the page ids of slots that are whole pages in order (an allocation's, on
either tier). :mod:`.direct_staging` stages chunks by them; :mod:`.chunk_slots` finds them
once an op."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy import count_nonzero


class Segment(NamedTuple):
    """Pairs ``[position, position + num_pages * length)`` of a chunk: ``num_pages`` consecutive
    host pages from ``page``, ``length`` slots of each from ``offset`` (whole pages:
    ``offset`` 0 and ``length`` the page size; a partial page: ``num_pages`` 1)."""

    position: int
    page: int
    offset: int
    num_pages: int
    length: int


def device_pages(device_slots: np.ndarray, page_size: int, num_slots: int
                 ) -> np.ndarray | None:
    """The device page of every ``page_size`` pairs of ``device_slots`` (an op's, int64, in
    the order it moves them) when each such group is one device page's slots in order (a
    page being ``page_size`` slots from a multiple of ``page_size``), else ``None`` (then,
    too, for a pool of ``num_slots`` that is not whole pages). An allocation of whole pages
    gives such slots, so a ``page_first_direct`` move of whole host pages gathers and
    scatters page by page (:meth:`DirectStaging.gather_device_pages`,
    :meth:`DirectStaging.scatter_device_pages`)."""
    if num_slots % page_size:
        return None
    return whole_pages(device_slots, page_size)


def whole_pages(slots: np.ndarray, page_size: int) -> np.ndarray | None:
    """The page of every ``page_size`` of ``slots`` (int64) when each such group is one
    page's slots in order (``page_size`` slots from a multiple of ``page_size``), else
    ``None`` (also for no slots)."""
    if slots.size == 0 or slots.size % page_size:
        return None
    grouped = slots.reshape(-1, page_size) - np.arange(page_size, dtype=np.int64)
    firsts = grouped[:, 0]
    if count_nonzero(grouped != firsts[:, None]) or count_nonzero(firsts % page_size):
        return None
    return firsts // page_size


def page_run_segments(pages: np.ndarray, page_size: int) -> tuple[list[Segment], np.ndarray]:
    """:func:`page_segments` of slots that are whole pages (``pages``: :func:`whole_pages`),
    and the position each segment starts at: runs of consecutive pages, found from one
    entry a page instead of every slot (a 256-token op's segments took about 40 us of its
    issue the general way, on a warm cache)."""
    heads = np.flatnonzero(pages[1:] != pages[:-1] + 1) + 1
    firsts = [0, *heads.tolist()]
    ends = [*firsts[1:], int(pages.size)]
    page_ids = pages[firsts].tolist()
    segments = [Segment(first * page_size, page, 0, end - first, page_size)
                for first, end, page in zip(firsts, ends, page_ids, strict=True)]
    return segments, np.array(firsts, dtype=np.int64) * page_size


def page_pieces(host_slots: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the runs of consecutive slots within one page each."""
    if host_slots.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    pages = host_slots // page_size
    cut = (np.diff(host_slots) != 1) | (np.diff(pages) != 0)
    starts = np.concatenate(([0], np.flatnonzero(cut) + 1)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [host_slots.size]))).astype(np.int64)
    return starts, lengths


def page_segments(host_slots: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                  page_size: int) -> list[Segment]:
    """Pieces joined into runs of consecutive whole pages; partial pages stay alone."""
    if starts.size == 0:
        return []
    first = host_slots[starts]
    pages, offsets = first // page_size, first % page_size
    whole = lengths == page_size
    joined = np.zeros(starts.size, dtype=bool)
    joined[1:] = whole[1:] & whole[:-1] & (pages[1:] == pages[:-1] + 1)
    heads = np.flatnonzero(~joined)
    counts = np.diff(np.concatenate((heads, [starts.size])))
    return [Segment(int(starts[h]), int(pages[h]), int(offsets[h]), int(count), int(lengths[h]))
            for h, count in zip(heads, counts, strict=True)]
