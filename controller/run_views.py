"""Views of one run of pairs (consecutive on the host and the device) for the ``direct``
backend: what its copies are planned from, and what its row-by-row path copies."""

from __future__ import annotations

import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout


def run_views(host_pool: HostKVPool, device_pool: DeviceKVPool, h: int, d: int, n: int,
              begin: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(host view, device view)`` of the run of ``n`` pairs from host slot ``h`` and device
    slot ``d`` for layers ``[begin, begin + count)``: both ``[components, count, tokens,
    row]``, or for whole pages of a ``page_first_direct`` host ``[components, count, pages,
    page_size, row]`` (a part of a page alone)."""
    host, device, end = host_pool.data, device_pool.data, begin + count
    layout = host_pool.layout
    if layout is HostLayout.LAYER_FIRST:
        return [(host[:, begin:end, h:h + n], device[:, begin:end, d:d + n])]
    if layout is HostLayout.PAGE_FIRST:
        return [(host[h:h + n, :, begin:end].permute(1, 2, 0, 3),
                 device[:, begin:end, d:d + n])]
    return _page_views(host, device, host_pool.page_size, h, d, n, begin, end)


def _page_views(host: torch.Tensor, device: torch.Tensor, page_size: int, h: int, d: int,
                n: int, begin: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The views of one run on a ``page_first_direct`` host (``[pages, components, layers,
    page_size, row]``): a part of a page alone, whole pages as one view of ``page_size``-row
    blocks."""
    views = []
    while n:
        page, offset = divmod(h, page_size)
        if offset or n < page_size:
            take = min(n, page_size - offset)
            views.append((host[page, :, begin:end, offset:offset + take],
                          device[:, begin:end, d:d + take]))
        else:
            pages = n // page_size
            take = pages * page_size
            device_rows = device[:, begin:end, d:d + take]
            views.append((host[page:page + pages, :, begin:end].permute(1, 2, 0, 3, 4),
                          device_rows.unflatten(2, (pages, page_size))))
        h, d, n = h + take, d + take, n - take
    return views
