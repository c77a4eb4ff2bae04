"""Tiers of the radix tree: backups to the host and eviction from both tiers.

Invariants kept here (checked by ``check_integrity``):

- device-resident nodes form an ancestor-closed set (a prefix is on the device or not);
- a node not on the device has a complete host copy (``is_backed_up``); a node that would
  lose its device slots without one is dropped, with the host-only nodes below it;
- a node with an op in flight is never evicted: write-through backups and load-backs lock
  their node until the ack; write-back evictions flag theirs with ``evict_on_ack``.

Write policies: ``write_through`` backs up on insert, ``write_through_selective`` once a
node was matched ``write_through_hits`` times, ``write_back`` only when eviction picks a node
that has no host copy; its device slots are freed when the write's ack is applied.

Thread ownership: the engine's scheduler thread is the only caller.
"""

from __future__ import annotations

import heapq

from hicache.config import EvictionPolicy, WritePolicy
from hicache.controller import CacheController, Direction, HybridCacheController

from .node import CacheStats, PendingOp, TreeNode
from .node_io import HybridNodeIO, NodeIO
from .tree import Clock, RadixTree, slots_of, subtree

_HeapEntry = tuple[tuple[float, ...], int, TreeNode]


class TieredRadixTree(RadixTree):
    """A :class:`RadixTree` whose nodes own device and host slots (arguments as for
    :class:`hicache.radix.HiRadixCache`)."""

    def __init__(
        self,
        controller: CacheController,
        *,
        write_policy: WritePolicy,
        write_through_hits: int,
        eviction_policy: EvictionPolicy,
        window_tokens: int | None,
        clock: Clock | None,
    ) -> None:
        if isinstance(controller, HybridCacheController):
            if window_tokens is None:
                raise ValueError("a hybrid controller needs window_tokens (model.window_tokens)")
            self.io: NodeIO = HybridNodeIO(controller, window_tokens)
        elif window_tokens is not None:
            raise ValueError("window_tokens is for hybrid (SWA) models; pass None")
        else:
            self.io = NodeIO(controller)
        if write_through_hits < 1:
            raise ValueError(f"write_through_hits must be >= 1, got {write_through_hits}")
        super().__init__(self.io.page_size, clock)
        self.controller = controller
        self.write_policy = write_policy
        self.eviction_policy = eviction_policy
        self.backup_hits = {WritePolicy.WRITE_THROUGH: 1, WritePolicy.WRITE_BACK: None,
                            WritePolicy.WRITE_THROUGH_SELECTIVE: write_through_hits}[write_policy]
        self.stats = CacheStats()

    # ---- eviction -----------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; returns tokens freed now.

        Unlocked device leaves go first, in eviction-policy order (ties by node id). A
        backed-up node keeps its host copy and stays in the tree. A node never backed up is
        dropped with any host-only nodes below it under ``write_through*``; under
        ``write_back`` it is written back first: its tokens count toward ``num_tokens`` but
        are freed by ``apply_acks`` once the write is acknowledged, so the return value can
        be smaller than ``num_tokens`` (retry after applying acks).
        """
        heap = [self._entry(n) for n in self.nodes() if self._can_evict_device(n)]
        heapq.heapify(heap)
        freed = scheduled = 0
        while heap and freed + scheduled < num_tokens:
            node = heapq.heappop(heap)[-1]
            if not self._can_evict_device(node):
                continue
            parent = node.parent
            if node.is_backed_up:
                freed += self._free_device(node)
            elif self.write_policy is not WritePolicy.WRITE_BACK:
                freed += self._drop(node, "no_backup")
            elif self._backup(node, evict_after=True):
                scheduled += node.num_tokens
                continue
            else:
                freed += self._drop(node, "host_full")
            if parent is not None and self._can_evict_device(parent):
                heapq.heappush(heap, self._entry(parent))
        if scheduled:
            self.controller.start_writing()
        self.stats.evicted_device_tokens += freed
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free the host copies of unlocked host-only leaves, removing those nodes, in
        eviction-policy order until ``num_tokens`` are freed; returns tokens freed. Nodes on
        the device and slots in flight are never touched."""
        heap = [self._entry(n) for n in self.nodes() if self._can_evict_host(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            node = heapq.heappop(heap)[-1]
            if not self._can_evict_host(node):
                continue
            parent = node.parent
            self.io.free_host(slots_of(node, "host"), node.host_swa)
            self._detach(node)
            freed += node.num_tokens
            if parent is not None and self._can_evict_host(parent):
                heapq.heappush(heap, self._entry(parent))
        self.stats.evicted_host_tokens += freed
        return freed

    # ---- backups ------------------------------------------------------------------------

    def _backup_nodes(self, nodes: list[TreeNode], path: list[TreeNode]) -> None:
        """Back up those of ``nodes`` that have no host copy, with ``path`` locked so that a
        host eviction made for room cannot remove part of it; then issue the writes."""
        todo = [n for n in nodes if n.on_device and n.host is None and n.load_op is None]
        if not todo:
            return
        self.lock(path[-1])
        try:
            for node in todo:
                self._backup(node, evict_after=False)
        finally:
            self.unlock(path[-1])
        self.controller.start_writing()

    def _backup(self, node: TreeNode, *, evict_after: bool) -> bool:
        """Queue a backup of ``node`` (the caller issues it with ``start_writing``); on a
        full host evict host leaves and retry once. False (counted) when there is no room."""
        op = PendingOp(Direction.DEVICE_TO_HOST, [node], None)
        device = slots_of(node, "device")
        slots = self.io.backup(device, op)
        if slots is None and self.evict_host(node.num_tokens) > 0:
            slots = self.io.backup(device, op)
        if slots is None:
            self.stats.refused_backups["host_full"] += node.num_tokens
            return False
        node.host, node.host_swa = slots
        node.write_op = op
        if evict_after:
            node.evict_on_ack = True
        else:
            op.lock_node = node
            self.lock(node)
        return True

    # ---- helpers ------------------------------------------------------------------------

    def _entry(self, node: TreeNode) -> _HeapEntry:
        if self.eviction_policy is EvictionPolicy.LFU:
            return (float(node.hit_count), node.last_access), node.node_id, node
        return (node.last_access,), node.node_id, node

    def _can_evict_device(self, node: TreeNode) -> bool:
        return (node is not self.root and node.on_device and node.lock_count == 0
                and not node.is_in_flight and not node.evict_on_ack
                and not node.has_device_child())

    def _can_evict_host(self, node: TreeNode) -> bool:
        if node is self.root or not node.is_host_only or node.children or node.lock_count:
            return False
        if node.is_in_flight or self.controller.is_in_flight(slots_of(node, "host")):
            return False
        return node.host_swa is None or not self.controller.is_in_flight(node.host_swa)

    def _free_device(self, node: TreeNode) -> int:
        """Free the device (and SWA) slots of ``node``; it stays in the tree."""
        self.io.free_device(slots_of(node, "device"))
        node.device = node.device_swa = None
        return node.num_tokens

    def _drop(self, node: TreeNode, reason: str) -> int:
        """Delete a never-backed-up device leaf and the host-only nodes below it (their host
        copies are useless without this node's KV); returns the device tokens freed."""
        below = [n for n in subtree(node) if n is not node]
        for orphan in below:
            assert orphan.is_host_only and not orphan.is_in_flight, f"cannot drop {orphan!r}"
            self.io.free_host(slots_of(orphan, "host"), orphan.host_swa)
        self.io.free_device(slots_of(node, "device"))
        self._detach(node)
        self.stats.dropped_tokens[reason] += node.num_tokens
        if below:
            self.stats.dropped_tokens["orphaned"] += sum(n.num_tokens for n in below)
        return node.num_tokens
