"""Memory pools: device KV pools (MHA, MLA), the hybrid SWA pool, pinned host pools, page
allocators and typed index spaces. Bookkeeping and storage only; data movement lives in
``hicache.controller``."""

from .allocator import PageAllocator
from .base import (
    DEBUG_CHECKS_ENV,
    PADDING_SLOT,
    AttentionKind,
    BoundsError,
    HostLayout,
    IndexSpace,
    Indices,
    PageTable,
    check_indices,
    debug_checks_enabled,
)
from .bounds import BoundsGuard
from .device import DeviceKVPool, RowGeometry
from .forward_locs import ForwardLocs
from .host import HostKVPool, as_layer_first
from .swa import HybridSWAPool

__all__ = [
    "DEBUG_CHECKS_ENV",
    "PADDING_SLOT",
    "AttentionKind",
    "BoundsError",
    "BoundsGuard",
    "DeviceKVPool",
    "ForwardLocs",
    "HostKVPool",
    "HostLayout",
    "HybridSWAPool",
    "IndexSpace",
    "Indices",
    "PageAllocator",
    "PageTable",
    "RowGeometry",
    "as_layer_first",
    "check_indices",
    "debug_checks_enabled",
]
