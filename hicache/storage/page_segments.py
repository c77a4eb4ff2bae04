"""A page's segments as a store moves them: a ``layer_first`` page through one copy.

A ``layer_first`` page is one segment per component and layer (64 for a 32-layer model),
evenly spaced in the host pool: the rows of one two-dimensional view. Handled one by one,
each is a Python object, a checksum update that holds the GIL and an entry in an I/O vector,
and a store's threads spend their interpreter time on them while the scheduler thread waits
for it. :class:`PageSegments` keeps that view (``rows``), and a store moves such a page
through this thread's scratch buffer instead: the rows copied into it by one call before a
write (:func:`payload`), or a read landing in it (:func:`landing`) and copied into the rows
once verified (:func:`land`). The copies and the checksum of one buffer run without the
GIL. Other pages (one segment: ``page_first``, ``page_first_direct``) are moved as they are.

A thread's scratch holds one page: what :func:`payload` or :func:`landing` returns is valid
until the same thread stages another page. It is as large as the largest such page the
thread moved (a 2 MiB page of a 32-layer model: 2 MiB) and goes with the thread.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

# A page goes through one copy only with this many segments of rows and this many bytes of
# them: below, its segments' own work takes less than the copy's calls (1-1.5 us a page;
# 64 segments of 64 bytes checksummed one by one took 1.4 us on a 2-CPU x86 machine).
MIN_SEGMENTS = 8
MIN_BYTES = 64 << 10


def worth_one_copy(num_segments: int, num_bytes: int) -> bool:
    """Whether a page of ``num_segments`` evenly spaced rows of ``num_bytes`` in all moves
    through one copy (see the module docstring)."""
    return num_segments >= MIN_SEGMENTS and num_bytes >= MIN_BYTES


class PageSegments(list[memoryview]):
    """A page's segments and, where they are the rows of one two-dimensional view (a
    ``layer_first`` page), that view as ``rows`` (the first ``len(rows)`` segments)."""

    rows: np.ndarray | None = None

    def with_segment(self, segment: memoryview) -> PageSegments:
        """These segments and ``segment`` after them (a hybrid page's SWA rows), the rows
        view kept."""
        joined = PageSegments([*self, segment])
        joined.rows = self.rows
        return joined


_scratch = threading.local()


def payload(segments: list[memoryview]) -> list[memoryview]:
    """The page's bytes in as few segments as it can: a page with ``rows`` as a copy of them
    in this thread's scratch buffer and its segments after the rows; another as it is."""
    rows = _rows(segments)
    if rows is None:
        return segments
    staged = _staged(rows)
    np.copyto(staged.reshape(rows.shape), rows)
    return [staged.data, *segments[len(rows):]]


def landing(segments: list[memoryview]) -> list[memoryview]:
    """Where a read of the page lands: for a page with ``rows`` this thread's scratch buffer
    (then :func:`land`) and its segments after the rows; another page's own segments."""
    rows = _rows(segments)
    if rows is None:
        return segments
    return [_staged(rows).data, *segments[len(rows):]]


def land(segments: list[memoryview]) -> None:
    """Copy a read that :func:`landing` put in this thread's scratch buffer into the page's
    rows (nothing to do for a page without them)."""
    rows = _rows(segments)
    if rows is not None:
        np.copyto(rows, _staged(rows).reshape(rows.shape))


def _rows(segments: list[memoryview]) -> np.ndarray | None:
    return segments.rows if type(segments) is PageSegments else None


def _staged(rows: np.ndarray) -> np.ndarray:
    """This thread's scratch buffer, cut to ``rows``' bytes (grown when too small; page
    aligned, so the file store can read into it with O_DIRECT)."""
    buffer: np.ndarray | None = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.nbytes < rows.nbytes:
        buffer = _scratch.buffer = np.frombuffer(mmap.mmap(-1, rows.nbytes), dtype=np.uint8)
    return buffer[:rows.nbytes]
