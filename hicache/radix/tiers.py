"""Tiers of the radix tree: backups to the host and eviction from both tiers.

Invariants kept here (checked by ``check_integrity``):

- device-resident nodes form an ancestor-closed set (a prefix is on the device or not);
- a node not on the device has a complete host copy (``is_backed_up``); a node that would
  lose its device slots without one is dropped, with the host-only nodes below it;
- a node with an op queued or in flight is never evicted: write-through backups and
  load-backs lock their node until the ack; write-back evictions flag theirs with
  ``evict_on_ack``.

Eviction takes nodes from two :class:`~hicache.radix.eviction.CandidateHeap` (device,
host), kept up to date from the nodes the tree reports as changed (``_touch``) and from the
changes eviction makes itself, so it never walks the tree.

Write policies: ``write_through`` backs up on insert, ``write_through_selective`` once a
node was matched ``write_through_hits`` times, ``write_back`` only when eviction picks a node
that has no host copy; its device slots are freed when the write's ack is applied. The
first two queue their backups, which :meth:`TieredRadixTree.issue_queued_backups` allocates
and issues together (:mod:`hicache.radix.backups`).

Applying an ack (``_finish_write``, ``_finish_load``) clears the op from its nodes and drops
the lock it held; the nodes become eviction candidates again.

Thread ownership: the engine's scheduler thread is the only caller.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.config import EvictionPolicy, WritePolicy
from hicache.controller import CacheController, HybridCacheController, TransferCore
from hicache.pools import IndexSpace, Indices

from . import backups, host_eviction
from .eviction import CandidateHeap, eviction_key
from .key import TOKEN_BYTES
from .node import CacheStats, PendingOp, TreeNode, cat_indices
from .node_io import HybridNodeIO, NodeIO
from .storage_hooks import StorageHooks
from .tree import Clock, RadixTree, slots_of, subtree


class TieredRadixTree(RadixTree):
    """A :class:`RadixTree` whose nodes own device and host slots (arguments as for
    :class:`hicache.radix.HiRadixCache`)."""

    def __init__(
        self,
        controller: TransferCore,
        *,
        write_policy: WritePolicy,
        write_through_hits: int,
        eviction_policy: EvictionPolicy,
        window_tokens: int | None,
        clock: Clock | None,
        keep_swa_history: bool = True,
    ) -> None:
        if isinstance(controller, HybridCacheController):
            if window_tokens is None:
                raise ValueError("a hybrid controller needs window_tokens (model.window_tokens)")
            self.io: NodeIO = HybridNodeIO(controller, window_tokens, keep_swa_history)
        elif window_tokens is not None:
            raise ValueError("window_tokens is for hybrid (SWA) models; pass None")
        elif isinstance(controller, CacheController):
            self.io = NodeIO(controller)
        else:
            raise TypeError(f"expected a CacheController or HybridCacheController, got "
                            f"{type(controller).__name__}")
        if write_through_hits < 1:
            raise ValueError(f"write_through_hits must be >= 1, got {write_through_hits}")
        super().__init__(self.io.page_size, clock)
        self.controller = controller
        self.write_policy = write_policy
        self.eviction_policy = eviction_policy
        self.backup_hits = {WritePolicy.WRITE_THROUGH: 1, WritePolicy.WRITE_BACK: None,
                            WritePolicy.WRITE_THROUGH_SELECTIVE: write_through_hits}[write_policy]
        self.stats = CacheStats()
        # Backups queued by insert and match are issued at once; a service turns this off
        # and issues them at its step() instead, all of a scheduler step as one op.
        self.issue_backups = True
        self.queued_backups: list[PendingOp] = []  # not issued yet (hicache.radix.backups)
        self.on_backup_queued: Callable[[], None] | None = None  # told of each (a service's)
        self.storage: StorageHooks | None = None  # the shared store's tier (hicache.l3)
        self.host_tokens_scheduled = 0  # the last evict_host's leaves kept for the store
        key = eviction_key(eviction_policy)
        self._device_candidates = CandidateHeap(key, self._can_evict_device)
        self._host_candidates = CandidateHeap(key, self._is_host_candidate)
        # device SWA rows that may leave on their own (hybrid models keeping SWA history)
        self._swa_candidates = CandidateHeap(key, self._is_swa_candidate)
        # host SWA copies that may leave on their own (the node keeps its full rows)
        self._host_swa_candidates = CandidateHeap(key, self._is_host_swa_candidate)
        self._heaps = (self._device_candidates, self._host_candidates) + (
            (self._swa_candidates, self._host_swa_candidates) if self.io.is_hybrid else ())

    # ---- eviction -----------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; returns tokens freed now.

        Unlocked device leaves go first, in eviction-policy order (ties by node id). A
        backed-up node keeps its host copy and stays in the tree. A node never backed up is
        dropped with any host-only nodes below it under ``write_through*``; under
        ``write_back`` it is written back first: its tokens count toward ``num_tokens`` but
        are freed by ``apply_acks`` once the write is acknowledged, so the return value can
        be smaller than ``num_tokens`` (retry after applying acks). When the host is full and
        the host leaves evicted for it leave only once the shared store has them (its
        ``write_back``), the node stays, touched, for a later call (its tokens count too).

        Costs per node evicted and per node changed since the last eviction (see
        :mod:`hicache.radix.eviction`), not per node of the tree.
        """
        self._refresh_candidates()
        freed = scheduled = 0
        released: list[Indices] = []  # device slots, freed in one controller call
        deferred: list[TreeNode] = []  # write-backs waiting for host room on its way
        try:
            while freed + scheduled < num_tokens:
                node = self._device_candidates.pop()
                if node is None:
                    break
                if node.is_backed_up:  # both branches offer the parent: it may join now
                    released.append(self._take_device(node))
                elif self.write_policy is not WritePolicy.WRITE_BACK:
                    released.append(self._drop(node, "no_backup"))
                else:
                    try:  # an observer's error or an interrupt: evictable at the next call
                        started = backups.allocate_one(self, node, evict_after=True)
                    except BaseException:
                        self._touch(node)
                        raise
                    if started is None:
                        deferred.append(node)
                        scheduled += node.num_tokens
                        continue
                    if started:
                        scheduled += node.num_tokens
                        continue
                    released.append(self._drop(node, "host_full"))
                freed += node.num_tokens
        finally:
            for node in deferred:
                self._touch(node)
            if released:
                self.io.free_device(cat_indices(released, IndexSpace.DEVICE_FULL))
            self.stats.evicted_device_tokens += freed  # also when a write-back's issue raises
        if scheduled:
            self.controller.start_writing()
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free the host copies of unlocked host-only leaves, removing those nodes, in
        eviction-policy order until ``num_tokens`` are freed; returns tokens freed. Nodes on
        the device and slots in flight are never touched. With a shared store under
        ``write_back``, a leaf not in the store is written there first and leaves later
        (its tokens count toward ``num_tokens``, not in the tokens returned)."""
        return host_eviction.evict_host(self, num_tokens)

    def evict_host_node(self, node: TreeNode) -> int:
        """Remove one host-only leaf (a host candidate) and free its host copy now."""
        return host_eviction.evict_host_nodes(self, [node])

    def _refresh_candidates(self) -> None:
        """Offer every node changed since the last eviction to the candidate heaps (those of
        SWA rows only for a hybrid model: no other node has any), and drop their stale
        entries once those pile up."""
        touched, self._touched = self._touched, {}
        for heap in self._heaps:
            heap.offer_all(touched, self.num_nodes)

    # ---- backups (hicache.radix.backups) ----------------------------------------------

    def _backup_nodes(self, nodes: list[TreeNode]) -> None:
        """Queue backups of those of ``nodes`` that have no host copy (see
        :func:`hicache.radix.backups.queue`)."""
        backups.queue(self, nodes)

    def issue_queued_backups(self, *, evict: bool = True) -> None:
        """Allocate and queue, as one controller write, every backup queued since the last
        call, then issue the controller's queued writes (see
        :func:`hicache.radix.backups.issue_queued`; ``evict=False``: only if they fit)."""
        backups.issue_queued(self, evict=evict)

    @property
    def has_queued_backups(self) -> bool:
        """Backups queued by ``insert`` or ``match`` and not issued yet."""
        return bool(self.queued_backups)

    # ---- acknowledgements ---------------------------------------------------------------

    def _finish_write(self, op: PendingOp) -> None:
        """A backup's ack: its nodes' host copies are valid, a write-through lock drops, and
        a write-back eviction frees the device slots (unless the node was locked or gained
        device children meanwhile)."""
        touched, key_bytes, flagged = self._touched, 0, False
        for node in op.nodes:
            assert node.write_op is op, f"{node!r} lost track of its write"
            node.write_op = None
            touched[node] = None  # _touch, inlined: every backup's ack comes here
            key_bytes += len(node.key)
            flagged = flagged or node.evict_on_ack
        self.stats.backed_up_tokens += key_bytes // TOKEN_BYTES
        if self.storage is not None:
            self.storage.host_copies_ready(op.nodes)
        for node in op.locks:
            self.unlock(node)
        if not flagged:  # a write-through backup: nothing leaves the device
            return
        for node in sorted(op.nodes, key=TreeNode.depth, reverse=True):
            if node.evict_on_ack:
                node.evict_on_ack = False
                if self._can_evict_device(node):
                    self.stats.evicted_device_tokens += self._free_device(node)

    def _finish_load(self, op: PendingOp) -> None:
        """A load-back's ack: its nodes' device rows are valid and its lock drops."""
        for node in op.nodes:
            assert node.load_op is op, f"{node!r} lost track of its load"
            node.load_op = None
            self._touch(node)
        assert op.locks, "a load-back always locks its last node"
        for node in op.locks:
            self.unlock(node)

    # ---- helpers ------------------------------------------------------------------------

    # Both predicates run per candidate on every eviction: plain field reads, no properties.

    def _can_evict_device(self, node: TreeNode) -> bool:
        """An unlocked device leaf (no child on the device) with nothing in flight."""
        return (node.device is not None and node.lock_count == 0 and node.write_op is None
                and node.load_op is None and not node.evict_on_ack and node is not self.root
                and not (node.children and node.has_device_child()))

    def _is_host_candidate(self, node: TreeNode) -> bool:
        """A host-only, unlocked leaf with no op of this tree in flight; O(1). The tree's
        flags cover every op on its host slots: they are set when the op is queued and
        cleared by the ack, after the controller let the slots go (``check_integrity``
        checks that no host page is in flight under a node without an op)."""
        return (node.device is None and node.host is not None and not node.children
                and node.lock_count == 0 and node.write_op is None and node.load_op is None
                and node.store_op is None and node is not self.root)

    def _is_swa_candidate(self, node: TreeNode) -> bool:
        """An unlocked node with device SWA rows and host SWA copies, nothing in flight; O(1)
        (which of its rows have a copy is looked at when it is popped)."""
        return (node.device_swa is not None and node.host_swa is not None
                and node.lock_count == 0 and node.write_op is None and node.load_op is None
                and node is not self.root)

    def _is_host_swa_candidate(self, node: TreeNode) -> bool:
        """An unlocked node with host SWA copies and nothing in flight; O(1). A put to the
        store in flight reads the SWA copies as it reads the full rows (a page goes to the
        store with its SWA rows), so they stay until it is back, as the full rows do."""
        return (node.host_swa is not None and node.lock_count == 0 and node.write_op is None
                and node.load_op is None and node.store_op is None and node is not self.root)

    def _free_device(self, node: TreeNode) -> int:
        """Free the device (and SWA) slots of ``node``; it stays in the tree."""
        self.io.free_device(self._take_device(node))
        return node.num_tokens

    def _take_device(self, node: TreeNode) -> Indices:
        """Remove the device (and SWA) slots from ``node``, which stays in the tree
        (host-only), and return its ``DEVICE_FULL`` slots for the caller to free."""
        device = slots_of(node, "device")
        node.device = node.device_swa = None
        self._host_candidates.offer(node)  # now host-only
        if node.parent is not None:
            # may have lost its last device child; during an eviction it joins at once
            self._device_candidates.offer(node.parent)
        return device

    def _drop(self, node: TreeNode, reason: str) -> Indices:
        """Delete a never-backed-up device leaf and the host-only nodes below it (their host
        copies are useless without this node's KV, and are freed); returns the leaf's
        ``DEVICE_FULL`` slots for the caller to free."""
        below = [n for n in subtree(node) if n is not node]
        for orphan in below:
            assert orphan.is_host_only and not orphan.is_in_flight, f"cannot drop {orphan!r}"
            if orphan.store_op is not None and self.storage is not None:
                self.storage.free_host_after_store(orphan, slots_of(orphan, "host"))
                continue
            self.io.free_host(slots_of(orphan, "host"), orphan.host_swa)
        if node.host is None:  # SWA copies of rows that left the window, nothing else
            self.io.free_host_swa(node.host_swa)
            node.host_swa = None
        self._detach(node)
        if node.parent is not None:
            self._device_candidates.offer(node.parent)  # may have become a device leaf
        self.stats.dropped_tokens[reason] += node.num_tokens
        if below:
            self.stats.dropped_tokens["orphaned"] += sum(n.num_tokens for n in below)
        return slots_of(node, "device")
