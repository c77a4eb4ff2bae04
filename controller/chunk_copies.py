"""The 2D copies of a staged chunk, from templates planned once per run shape.

A chunk's copies (:func:`~hicache.controller.copy2d.plan_copies`) depend on where its host
runs start only through two byte offsets: a run of ``length`` slots at host slot ``first``,
staged at chunk position ``offset``, is the run of the same length at host slot 0 and
position 0, shifted by ``first`` host slots and ``offset`` staged slots (a slot is a row in a
``layer_first`` host and staging, a token's rows in a ``page_first`` one). Likewise a
``page_first_direct`` segment of ``num_pages`` pages of ``length`` slots is the segment at
page 0, slot 0, position 0, shifted by its page, its slot in the page and its position.

So a run's copies are planned once (from two tensor views, which cost microseconds each)
per pool and staging geometry, block of layers and length, and kept in a
:class:`CopyTemplates` that the staged backend shares across ops; every other run of that
shape costs one dictionary lookup and one shift. Issuing a 32k-token layer-wise load used
to plan every chunk from views (about 1 ms of CPU per op on an H100 host, measured).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import copy2d
from .copy2d import Copy2D, shifted
from .slot_segments import Segment

MAX_TEMPLATES = 4096  # run shapes kept (a few per pool geometry and layer shape in practice)

class CopyTemplates:
    """Copies planned for runs of one shape at offset 0, by a key that names the shape (the
    host buffer's and the staging view's geometry, the block of layers and the run)."""

    def __init__(self) -> None:
        self._known: dict[tuple[object, ...], list[Copy2D]] = {}
        self.planned = 0  # read by tests: templates made

    def get(self, key: tuple[object, ...]) -> list[Copy2D] | None:
        """The template of ``key``, or ``None`` before :meth:`plan` made it."""
        return self._known.get(key)

    def plan(self, key: tuple[object, ...], host: torch.Tensor, staged: torch.Tensor,
             host_base: int, staged_base: int) -> list[Copy2D]:
        """Plan and keep the template of ``key`` from the run at offset 0 (its ``host`` and
        ``staged`` views), relative to ``host_base`` and ``staged_base``."""
        if len(self._known) >= MAX_TEMPLATES:
            self._known.clear()
        known = self._known[key] = copy2d.plan_copies(host, staged, host_base, staged_base)
        self.planned += 1
        return known


def run_copies(templates: CopyTemplates, host: torch.Tensor, staged: torch.Tensor,
               token_major: bool, runs: Sequence[tuple[int, int]], host_slots: np.ndarray,
               block_offset: int, count: int) -> list[Copy2D]:
    """The copies of every host run (``(position, length)``; its first host slot is
    ``host_slots[position]``) for host layers ``0 .. count - 1`` staged at ``block_offset``
    of the moved layers: ``host`` is ``[C, L, slots, row]`` (``layer_first``) or ``[slots,
    C, L, row]`` (``page_first``, ``token_major``), ``staged`` the chunk's staging view laid
    out alike (``[C, layers, n, row]`` or ``[n, C, layers, row]``)."""
    slot_dim = 0 if token_major else 2
    size = host.element_size()
    host_step, staged_step = host.stride(slot_dim) * size, staged.stride(slot_dim) * size
    host_base, staged_base = host.data_ptr(), staged.data_ptr()
    geometry = (host.shape, host.stride(), host.dtype, staged.shape, token_major,
                block_offset, count)
    copies: list[Copy2D] = []
    for position, length in runs:
        template = templates.get((geometry, length))
        if template is None:
            if token_major:
                views = (host[:length, :, :count],
                         staged[:length, :, block_offset: block_offset + count])
            else:
                views = (host[:, :count, :length],
                         staged[:, block_offset: block_offset + count, :length])
            template = templates.plan((geometry, length), *views, host_base, staged_base)
        copies += shifted(template, int(host_slots[position]) * host_step,
                          position * staged_step)
    return copies


def segment_copies(templates: CopyTemplates, host: torch.Tensor, rows: torch.Tensor,
                   segments: Sequence[Segment], num_components: int, num_layers: int,
                   block_offset: int, count: int) -> list[Copy2D]:
    """The copies of every segment of a ``page_first_direct`` chunk for host layers ``0 ..
    count - 1`` staged at ``block_offset`` of its ``num_layers`` moved layers: ``host`` is
    ``[pages, C, L, page_size, row]``, ``rows`` the chunk's staging ``[C * layers * pairs,
    row]``, a segment at position ``p`` staged as ``[pages, C, layers, length, row]`` from
    row ``p * C * layers`` (:class:`~hicache.controller.direct_staging.DirectStaging`)."""
    size = host.element_size()
    page_step, slot_step = host.stride(0) * size, host.stride(3) * size
    position_step = num_components * num_layers * rows.stride(0) * size
    host_base, staged_base = host.data_ptr(), rows.data_ptr()
    c, n, row = num_components, num_layers, rows.shape[-1]
    geometry = (host.shape, host.stride(), host.dtype, rows.stride(), c, n, block_offset,
                count)
    copies: list[Copy2D] = []
    for segment in segments:
        pages, length = segment.num_pages, segment.length
        template = templates.get((geometry, pages, length))
        if template is None:
            staged = rows[: pages * length * c * n].view(pages, c, n, length, row)
            template = templates.plan((geometry, pages, length),
                                      host[:pages, :, :count, :length],
                                      staged[:, :, block_offset: block_offset + count],
                                      host_base, staged_base)
        copies += shifted(template, segment.page * page_step + segment.offset * slot_step,
                          segment.position * position_step)
    return copies
