"""A page's segments as a store moves them: a ``layer_first`` page through one copy.

A ``layer_first`` page is one segment per component and layer (64 for a 32-layer model),
evenly spaced in the host pool: the rows of one two-dimensional view. Handled one by one,
each is a Python object, a checksum update that holds the GIL and an entry in an I/O vector,
and a store's threads spend their interpreter time on them while the scheduler thread waits
for it. :func:`hicache.storage.host_page_views` gives such a page as a :class:`PageRows`
(that view, and a sequence of its segments made only when asked for), and a store moves it
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
from collections.abc import Sequence
from typing import overload

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


class PageRows(Sequence[memoryview]):
    """A page given by ``rows``, the rows of one two-dimensional view of a host pool (a
    ``layer_first`` page: one row per component and layer, evenly spaced), and ``extra``
    segments after them (a hybrid page's SWA rows). A sequence of its segments, each view
    made when asked for; a store moves the page through one copy and never makes them."""

    __slots__ = ("extra", "rows")

    def __init__(self, rows: np.ndarray, extra: tuple[memoryview, ...] = ()) -> None:
        self.rows = rows
        self.extra = extra

    def __len__(self) -> int:
        return len(self.rows) + len(self.extra)

    @overload
    def __getitem__(self, index: int) -> memoryview: ...

    @overload
    def __getitem__(self, index: slice) -> list[memoryview]: ...

    def __getitem__(self, index: int | slice) -> memoryview | list[memoryview]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"segment {index} of a page of {len(self)}")
        if position < len(self.rows):
            return self.rows[position].data
        return self.extra[position - len(self.rows)]

    def with_segment(self, segment: memoryview) -> PageRows:
        """This page with ``segment`` after its segments (a hybrid page's SWA rows)."""
        return PageRows(self.rows, (*self.extra, segment))


_scratch = threading.local()


def payload(page: Sequence[memoryview]) -> Sequence[memoryview]:
    """The page's bytes in as few segments as it can: a :class:`PageRows` as a copy of its
    rows in this thread's scratch buffer and its extra segments; another page as it is."""
    if type(page) is not PageRows:
        return page
    staged = _staged(page.rows)
    np.copyto(staged.reshape(page.rows.shape), page.rows)
    return [staged.data, *page.extra]


def landing(page: Sequence[memoryview]) -> Sequence[memoryview]:
    """Where a read of the page lands: for a :class:`PageRows` this thread's scratch buffer
    (then :func:`land`) and its extra segments; another page's own segments."""
    if type(page) is not PageRows:
        return page
    return [_staged(page.rows).data, *page.extra]


def land(page: Sequence[memoryview]) -> None:
    """Copy a read that :func:`landing` put in this thread's scratch buffer into the page's
    rows (nothing to do for another page)."""
    if type(page) is PageRows:
        np.copyto(page.rows, _staged(page.rows).reshape(page.rows.shape))


def _staged(rows: np.ndarray) -> np.ndarray:
    """This thread's scratch buffer, cut to ``rows``' bytes (grown when too small; page
    aligned, so the file store can read into it with O_DIRECT)."""
    buffer: np.ndarray | None = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.nbytes < rows.nbytes:
        buffer = _scratch.buffer = np.frombuffer(mmap.mmap(-1, rows.nbytes), dtype=np.uint8)
    return buffer[:rows.nbytes]
