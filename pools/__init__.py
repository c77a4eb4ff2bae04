"""Memory pools: device KV pools (MHA, MLA), the hybrid SWA pool, pinned host pools, page
allocators and typed index spaces. Bookkeeping and storage only; data movement lives in
``hicache.controller``."""

from .allocator import PageAllocator
from .base import (
    DEBUG_CHECKS_ENV,
    PADDING_SLOT,
    AttentionKind,
    HostLayout,
    IndexSpace,
    Indices,
    check_indices,
    debug_checks_enabled,
)
from .device import DeviceKVPool, RowGeometry
from .host import HostKVPool
from .swa import HybridSWAPool

__all__ = [
    "DEBUG_CHECKS_ENV",
    "PADDING_SLOT",
    "AttentionKind",
    "DeviceKVPool",
    "HostKVPool",
    "HostLayout",
    "HybridSWAPool",
    "IndexSpace",
    "Indices",
    "PageAllocator",
    "RowGeometry",
    "check_indices",
    "debug_checks_enabled",
]
