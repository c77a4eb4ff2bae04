"""What the bare pipeline of ``hicache bench e2e`` copies: the cached prefix's bytes in the
service's own host pool, the very pages its host hit reads.

Why not a buffer of its own: where a pinned buffer's pages lie moves the copy engine's rate
by up to 15% between buffers on the H100 measured (the same 2D copies read 83-91% of the
ceiling over one buffer and 98% over another), and every run allocates its buffers anew.
A bare copy from another buffer then measures the two buffers' placement as much as the
load path's cost. From the pool's pages it compares the load path with a copy of the same
bytes from the same memory.

On a ``layer_first`` host the pieces are exactly each layer's K and V rows (a run of slots
is contiguous per component and layer). On the other layouts a layer's rows are spread
over every page, so the prefix's pages (contiguous bytes) are cut into as many equal pieces
per layer: the same bytes from the same pages, one contiguous copy per piece, as a bare
copy is. The pieces are copied to a device scratch buffer; the forward reads the prefix's
rows from the dense buffers, which already hold them.
"""

from __future__ import annotations

import torch

from hicache.pools import HostLayout, IndexSpace
from hicache.radix.load_back import host_span
from hicache.radix.node import cat_indices
from hicache.radix.tree import slots_of
from hicache.service import HiCacheService

from ..workload import BenchmarkError

# per layer, the host pieces of its K and V bytes (1-D views of the host pool's buffer)
BareSources = list[tuple[torch.Tensor, torch.Tensor]]


def prefix_host_slots(service: HiCacheService, tokens: list[int]) -> torch.Tensor:
    """The host slots of the cached ``tokens`` (a host-only prefix), in token order: those
    a load-back of it would read (:func:`~hicache.radix.load_back.host_span`).

    Raises:
        BenchmarkError: the tokens are not all on the host.
    """
    tree = service.tree
    span = host_span(tree, service.match(tokens).last_host_node)
    slots = cat_indices([slots_of(node, "host") for node in span], IndexSpace.HOST_FULL).tensor
    if slots.numel() != len(tokens):
        raise BenchmarkError(f"the {len(tokens)}-token prefix has {slots.numel()} host slots")
    return slots


def pool_sources(service: HiCacheService, tokens: list[int], num_layers: int) -> BareSources:
    """Per layer, the host pieces (K, V) that the bare pipeline copies: the prefix's bytes in
    the host pool (see the module docstring).

    Raises:
        BenchmarkError: the prefix's host slots are not one run of whole pages (a fresh
            pool's are).
    """
    host = service.controller.host_pool
    slots = prefix_host_slots(service, tokens)
    first, count = int(slots[0]), slots.numel()
    page = host.page_size
    if (not torch.equal(slots, torch.arange(first, first + count)) or first % page
            or count % page):
        raise BenchmarkError(f"the {count}-token prefix's host slots are not one run of "
                             f"whole pages; the bare copy reads its bytes in place")
    data = host.data
    if host.layout is HostLayout.LAYER_FIRST:  # [components, layers, slots, row]
        return [(data[0, layer, first:first + count].reshape(-1),
                 data[1, layer, first:first + count].reshape(-1))
                for layer in range(num_layers)]
    region = (data[first:first + count] if host.layout is HostLayout.PAGE_FIRST
              else data[first // page:(first + count) // page]).reshape(-1)
    pieces = region.view(num_layers, 2, -1)
    return [(pieces[layer, 0], pieces[layer, 1]) for layer in range(num_layers)]
