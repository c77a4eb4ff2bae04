"""Eviction candidates of one tier, kept up to date instead of found by a scan of the tree.

A :class:`CandidateHeap` is a lazy min-heap of ``(key, node id)`` over the nodes a tier may
evict. The tree reports every node whose eviction state or key may have changed (access,
insert, split, unlock reaching 0, ack, a child leaving, slots gained or freed); those are
offered to the heaps before the next eviction, and a node that becomes a candidate during
an eviction (a parent whose last child left that tier) is offered at once. Entries are
never updated in place: an entry whose key is no longer the node's, or whose node no
longer qualifies, is dropped when it reaches the top, and the heap is compacted when such
entries outnumber the live ones. So an eviction costs per node it evicts and per change
since the last one, never per node of the tree, and picks exactly the nodes a full scan in
key order would.

Bookkeeping only: plain Python on the scheduler thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable

from hicache.config import EvictionPolicy

from .node import TreeNode

# LRU: the last access; LFU: (hit count, last access). Keys of one policy have one type.
Key = float | tuple[float, float]
# (key, node id, push sequence, node): the sequence keeps two entries of one node (same key
# and id) from ever comparing the nodes themselves.
_Entry = tuple[Key, int, int, TreeNode]

# A heap is compacted when it holds more than this many entries per node of the tree (plus
# a constant), i.e. when stale entries outnumber live ones at least twice over.
_ENTRIES_PER_NODE = 3
_MIN_ENTRIES = 64


def eviction_key(policy: EvictionPolicy) -> Callable[[TreeNode], Key]:
    """The eviction order of ``policy``, smallest first (ties are broken by node id): LRU
    by last access, LFU by hit count, then last access."""
    if policy is EvictionPolicy.LFU:
        return lambda node: (float(node.hit_count), node.last_access)
    return lambda node: node.last_access


class CandidateHeap:
    """The eviction candidates of one tier in eviction order.

    Invariant: every attached node for which ``is_candidate`` holds has an entry with its
    current key (the tree offers each node whose state or key may have changed).

    Args:
        key: the eviction order of a node (see :func:`eviction_key`).
        is_candidate: whether a node may be evicted from this tier now; O(1) per node.
    """

    def __init__(self, key: Callable[[TreeNode], Key],
                 is_candidate: Callable[[TreeNode], bool]) -> None:
        self._key = key
        self._is_candidate = is_candidate
        self._heap: list[_Entry] = []
        self._sequence = itertools.count()

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._heap)

    def offer(self, node: TreeNode) -> None:
        """Add ``node`` if it is a candidate now, with its current key; O(log n)."""
        if node.is_detached or not self._is_candidate(node):
            return
        heapq.heappush(self._heap, (self._key(node), node.node_id, next(self._sequence), node))

    def offer_all(self, nodes: Iterable[TreeNode], num_nodes: int) -> None:
        """:meth:`offer` each of ``nodes``, then :meth:`compact_if_stale` (``num_nodes``:
        the tree's), in one call: the refresh before every eviction offers every node
        changed since the last one to every heap."""
        heap, key, is_candidate, sequence = (self._heap, self._key, self._is_candidate,
                                             self._sequence)
        push = heapq.heappush
        for node in nodes:
            if not node.is_detached and is_candidate(node):
                push(heap, (key(node), node.node_id, next(sequence), node))
        if len(heap) > _ENTRIES_PER_NODE * num_nodes + _MIN_ENTRIES:
            self.compact_if_stale(num_nodes)

    def pop(self) -> TreeNode | None:
        """Remove and return the first candidate in eviction order, or ``None`` if there is
        none. The node is not offered again until the tree reports a change of it."""
        heap, key, is_candidate, pop = self._heap, self._key, self._is_candidate, heapq.heappop
        while heap:  # _is_live, inlined: a call less per entry popped
            entry = pop(heap)
            node = entry[3]
            if not node.is_detached and entry[0] == key(node) and is_candidate(node):
                return node
        return None

    def _is_live(self, entry: _Entry) -> bool:
        """The entry's node is attached, still has the entry's key and is a candidate."""
        node = entry[3]
        return not node.is_detached and entry[0] == self._key(node) and self._is_candidate(node)

    def compact_if_stale(self, num_nodes: int) -> None:
        """Rebuild the heap from its live entries (one per node) once it holds more than
        ``_ENTRIES_PER_NODE`` entries per node of the tree (``num_nodes``): at least two in
        three entries are stale then, so the rebuild is amortised O(1) per offer."""
        if len(self._heap) <= _ENTRIES_PER_NODE * num_nodes + _MIN_ENTRIES:
            return
        live = {entry[3]: entry for entry in self._heap if self._is_live(entry)}
        self._heap = list(live.values())
        heapq.heapify(self._heap)
