"""A staged chunk's whole device pages: where every host page of the chunk's pairs is one
device page's slots in order (``ChunkPlan.page_span``, for ``layer_first`` and
``page_first_direct`` hosts), the gather and the scatter index pages, not slots. They run
as the page copy kernel's launches (:mod:`.page_kernel`), made once per staging buffer,
chunk length and layer group; where the kernel cannot serve (a CPU pool), a
``page_first_direct`` chunk copies the pages with torch's indexed copies and a
``layer_first`` chunk leaves its slots to the slot-by-slot paths."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .layer_blocks import BlockShape
from .page_kernel import PageLaunch, launch_pages, page_launches
from .staged_views import LayerGroup, StagingBuffer

if TYPE_CHECKING:
    from .staged_chunk import ChunkPlan


def kernel_launches(plan: ChunkPlan, group: LayerGroup, buffer: StagingBuffer,
                    scatter: bool) -> list[PageLaunch] | None:
    """The page kernel's launches that move ``plan``'s whole device pages from (``scatter``)
    or into ``buffer`` for ``group``'s layers, or ``None`` where the kernel cannot serve
    the chunk (no page ids it can read, views it cannot copy, no kernel)."""
    if plan.kernel_pages is None:
        return None
    return _launches(plan, buffer, group, scatter)


def move_pages(plan: ChunkPlan, group: LayerGroup, buffer: StagingBuffer,
               scatter: bool) -> bool:
    """Copy ``plan``'s whole device pages from (``scatter``) or into ``buffer`` for
    ``group``'s layers; False, with nothing issued, when the chunk has no page index or
    only its slots can be moved (the caller's paths then)."""
    if plan.page_span is None:
        return False
    launches = kernel_launches(plan, group, buffer, scatter)
    if launches is not None and plan.kernel_pages is not None:
        launch_pages(launches, plan.kernel_pages)
        return True
    direct, index = plan.direct, plan.page_index
    if direct is None or index is None:
        return False
    staged = staged_pages(plan, buffer, group.shape)
    if scatter:
        direct.scatter_device_pages(staged, index, group.paged_rows)
    else:
        direct.gather_device_pages(staged, index, group.paged_rows)
    return True


def staged_pages(plan: ChunkPlan, buffer: StagingBuffer, shape: BlockShape
                 ) -> list[torch.Tensor]:
    """The chunk's staging rows (wide) in ``buffer`` as ``[C, count, pages, page_size,
    row]`` per block of layers of ``shape``, made once per buffer, chunk length and shape:
    page-major staging permuted (:meth:`~.direct_staging.DirectStaging.page_views`), or
    layer-major staging ``[C, layers, pairs, row]`` cut into pages."""
    key = ("pages", plan.numel, plan.wide_shape, plan.page_size, shape)
    views = buffer.get(key)
    if views is None:
        rows = plan.rows(buffer)
        if plan.direct is not None:
            views = plan.direct.page_views(rows, shape)
        else:
            c, layers, pairs, width = rows.shape
            paged = rows.view(c, layers, pairs // plan.page_size, plan.page_size, width)
            views = [paged.narrow(1, offset, count) for offset, count in shape]
        buffer.keep(key, views)
    assert isinstance(views, list)
    return views


def _launches(plan: ChunkPlan, buffer: StagingBuffer, group: LayerGroup, scatter: bool
              ) -> list[PageLaunch] | None:
    """The kernel's launches between ``buffer`` and ``group`` for chunks like ``plan``, kept
    in the buffer under the device views' addresses and strides (``group.paged_key``: a pool
    made later at the same address with the same shape gets the same, valid, launches; no
    reference keeps a pool's memory); ``None``: not served."""
    key = ("launch", plan.numel, plan.wide_shape, group.paged_key, scatter)
    found = buffer.get(key)
    if found is None:
        found = buffer.keep(key, page_launches(staged_pages(plan, buffer, group.shape),
                                               group.paged_rows, scatter) or False)
    return found or None  # type: ignore[return-value]
