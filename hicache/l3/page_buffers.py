"""A page's bytes as the store sees them, from and into the host pools.

Full rows are read and written in place: ``host_page_views`` gives the segments of a
page of the full host pool, whose slots the host allocator hands out in whole pages (a
``layer_first`` page of many segments as the view of its rows, which the store moves through
one copy: :mod:`hicache.storage.page_segments`). A
hybrid model's page adds its SWA rows as one more segment, in token order
(``[page_size, components, SWA layers, row]``): a node's SWA host slots are aligned with its
tokens but not whole pages of the SWA pool, so they are gathered into a buffer to be put,
and a get lands in a buffer that is then scattered into freshly allocated SWA slots.

Worker threads only (the jobs); reads and writes touch only the slots named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache.pools import HostKVPool, IndexSpace, Indices
from hicache.storage import byte_view, host_page_views
from hicache.storage.page_segments import PageRows


@dataclass(frozen=True)
class HostPools:
    """The host pools a page's rows live in: full rows, and SWA rows for a hybrid model."""

    full: HostKVPool
    swa: HostKVPool | None = None


def put_buffers(pools: HostPools, host: torch.Tensor, swa: torch.Tensor | None
                ) -> list[Sequence[memoryview]]:
    """One segment list per page of ``host`` (whole full-pool pages), plus the gathered SWA
    rows of ``swa`` (aligned with ``host``, every entry a slot) for a hybrid model."""
    pages = host_page_views(pools.full, Indices(host, IndexSpace.HOST_FULL))
    if pools.swa is None:
        return pages
    assert swa is not None and len(swa) == len(host)
    rows = pools.swa.read_rows(Indices(swa, IndexSpace.HOST_SWA))
    page = pools.full.page_size
    return [_with_segment(segments, byte_view(rows[i * page:(i + 1) * page]))
            for i, segments in enumerate(pages)]


class GetBuffers:
    """Destinations of a get of whole pages: full rows in place, SWA rows via a buffer
    that :meth:`scatter` writes into ``swa`` slots once pages arrived."""

    def __init__(self, pools: HostPools, host: torch.Tensor, swa: torch.Tensor | None) -> None:
        self.pools = pools
        self.swa = swa
        self.pages = host_page_views(pools.full, Indices(host, IndexSpace.HOST_FULL))
        self._rows: torch.Tensor | None = None
        if pools.swa is not None:
            assert swa is not None and len(swa) == len(host)
            geometry = pools.swa.geometry
            self._rows = torch.empty((len(host), geometry.num_components, pools.swa.num_layers,
                                      geometry.row_elems), dtype=geometry.dtype)
            page = pools.full.page_size
            self.pages = [_with_segment(segments, byte_view(self._rows[i * page:(i + 1) * page]))
                          for i, segments in enumerate(self.pages)]

    def scatter(self, start: int, end: int) -> None:
        """Write the SWA rows of pages ``[start, end)`` into their SWA slots."""
        if self._rows is None or self.pools.swa is None or self.swa is None:
            return
        page = self.pools.full.page_size
        slots = Indices(self.swa[start * page:end * page], IndexSpace.HOST_SWA)
        self.pools.swa.write_rows(slots, self._rows[start * page:end * page])


def _with_segment(segments: Sequence[memoryview], segment: memoryview
                  ) -> Sequence[memoryview]:
    """A page's full-row segments and its SWA rows after them (a layer_first page stays a
    :class:`PageRows`, moved through one copy)."""
    if isinstance(segments, PageRows):
        return segments.with_segment(segment)
    return [*segments, segment]
