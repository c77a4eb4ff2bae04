"""Host eviction: host-only leaves leave the tree in the eviction policy's order.

Plain functions of :class:`~hicache.radix.tiers.TieredRadixTree` (its ``evict_host`` and
``evict_host_node`` call them), on the scheduler thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.pools import IndexSpace, Indices

from .key import TOKEN_BYTES
from .node import TreeNode, cat_indices
from .tree import slots_of

if TYPE_CHECKING:
    from .tiers import TieredRadixTree


def evict_host(tree: TieredRadixTree, num_tokens: int) -> int:
    """See :meth:`TieredRadixTree.evict_host`."""
    tree._refresh_candidates()
    chosen: list[TreeNode] = []
    freed = scheduled = 0
    try:
        while freed + scheduled < num_tokens:
            node = tree._host_candidates.pop()
            if node is None:
                break
            if tree.storage is not None and tree.storage.keep_for_store(node):
                # written back to the store first; leaves when that is done, and counts
                # toward what was asked (else every host leaf would be written back)
                scheduled += node.num_tokens
                continue
            chosen.append(node)
            freed += node.num_tokens
            # detached now, so that its parent can become a leaf and be popped next
            parent = node.parent
            tree._detach(node)
            if parent is not None:
                tree._host_candidates.offer(parent)
    finally:  # whatever left the tree gives its slots back
        freed = _free(tree, chosen)
        tree.host_tokens_scheduled = scheduled
    return freed


def evict_host_nodes(tree: TieredRadixTree, nodes: list[TreeNode]) -> int:
    """Remove ``nodes`` (host candidates) and free their host copies; tokens freed."""
    for node in nodes:
        assert tree._is_host_candidate(node), f"{node!r} cannot leave the host now"
        parent = node.parent
        tree._detach(node)
        if parent is not None:
            tree._host_candidates.offer(parent)
    return _free(tree, nodes)


def _free(tree: TieredRadixTree, nodes: list[TreeNode]) -> int:
    """Free the host (and SWA host) slots of detached ``nodes`` in one controller call."""
    if not nodes:
        return 0
    hosts = [slots_of(node, "host") for node in nodes]
    swa = None
    if tree.io.is_hybrid:  # aligned SWA host slots, 0 where a token has none
        swa = cat_indices([node.host_swa if node.host_swa is not None
                           else Indices(torch.zeros(node.num_tokens, dtype=torch.int64),
                                        IndexSpace.HOST_SWA) for node in nodes],
                          IndexSpace.HOST_SWA)
    tree.io.free_host(cat_indices(hosts, IndexSpace.HOST_FULL), swa)
    freed = sum([len(node.key) for node in nodes]) // TOKEN_BYTES
    tree.stats.evicted_host_tokens += freed
    return freed
