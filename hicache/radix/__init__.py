"""The hierarchical radix tree: cached prefixes of token ids whose KV rows live on two tiers.

- :mod:`~hicache.radix.cache`: :class:`HiRadixCache`, what the service drives (match,
  insert, load-back, acks, integrity);
- :mod:`~hicache.radix.tiers`: :class:`TieredRadixTree`, the write and eviction policies
  and what an op's ack changes;
- :mod:`~hicache.radix.load_back`: a match's host-only run brought back to the device;
- :mod:`~hicache.radix.eviction`: the per-tier heaps of eviction candidates;
- :mod:`~hicache.radix.tree`: :class:`RadixTree`, the tree's shape (pages, matching, splits);
- :mod:`~hicache.radix.key`: :class:`TokenKey`, a request's token ids checked once;
- :mod:`~hicache.radix.node`: :class:`TreeNode`, :class:`MatchResult`, :class:`LoadBack` and
  the counters;
- :mod:`~hicache.radix.window_tail`, :mod:`~hicache.radix.window_backups`: the SWA rows of
  sliding-window models on the host tier (window restores, backups, SWA eviction);
- :mod:`~hicache.radix.node_io`: how nodes' slots move through the controller, and the
  slots ``insert`` takes from the engine;
- :mod:`~hicache.radix.integrity`: the conservation check behind ``check_integrity``.

Bookkeeping only: nothing here touches a stream (the controller does).
"""

from __future__ import annotations

from .cache import HiRadixCache
from .key import TokenIds, TokenKey
from .node import CacheStats, LoadBack, MatchResult, PendingOp, Refusal, TreeNode
from .tiers import TieredRadixTree
from .tree import Clock, RadixTree

__all__ = [
    "CacheStats",
    "Clock",
    "HiRadixCache",
    "LoadBack",
    "MatchResult",
    "PendingOp",
    "RadixTree",
    "Refusal",
    "TieredRadixTree",
    "TokenIds",
    "TokenKey",
    "TreeNode",
]
