"""HiRadixCache: a page-aligned radix tree over token ids whose nodes live on two tiers.

A node's KV rows sit on the device (``DEVICE_FULL`` slots), on the host (``HOST_FULL``), or
both; hybrid models add aligned SWA slots. Device-resident nodes form an ancestor-closed
set and every other node has a complete host copy, so a match is a device prefix followed
by a host-only run that :meth:`HiRadixCache.load_back` brings back (:mod:`.load_back`);
policies (write and eviction) live in :mod:`.tiers`, the tree's shape in :mod:`.tree`.

Slot ownership (the contract with the engine):

- ``insert(tokens, device_indices)`` takes ownership of ``device_indices[:n]``, where ``n``
  is ``len(tokens)`` rounded down to whole pages; slots after ``n`` stay the caller's (it
  frees the partial tail page). For tokens already cached, a slot equal to the tree's own
  slot at that position is kept as is; a different one is a duplicate and the tree frees it.
  So after ``insert`` the caller never frees any of ``device_indices[:n]``, whether those
  slots came from a match, a load-back or its own allocation.
- A :class:`MatchResult` stays valid only while ``last_device_node`` is locked, or until the
  next call that mutates the tree (``insert``, ``evict``, ``load_back``, ``apply_acks``).
- Load-backs are queued by ``load_back`` and issued by :meth:`start_loading`, which the
  engine calls when the batch that reads them starts.

Hybrid models: on insert the tree keeps SWA slots only for the window tail of the sequence
(``window_tokens`` rounded up to pages) and releases the rest of the slots it takes over;
slots it already owned keep theirs. Backups carry the SWA rows a node still has; load-backs
give SWA rows to the window tail of the loaded span and are refused when that tail has no
SWA host copy. The SWA rows of the device prefix before a load-back are the engine's concern.

Thread ownership: every method is called on the engine's scheduler thread, which owns the
tree and the allocators (:class:`hicache.service.HiCacheService` serialises controller
access with its lock).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from hicache.config import EvictionPolicy, WritePolicy
from hicache.controller import Ack, Direction, TransferCore
from hicache.pools import IndexSpace, Indices
from hicache.pools.serial_copies import int64_copy, joined

from .integrity import check_tree
from .key import TOKEN_BYTES, TokenIds, TokenKey
from .load_back import load_back
from .node import LoadBack, MatchResult, PendingOp, TreeNode, cat_indices
from .tiers import TieredRadixTree
from .tree import Clock
from .window_backups import WindowBackupOp, WindowBackups
from .window_tail import (
    back_up_window,
    evict_swa,
    finish_window_backup,
    refuse_copies_in_flight,
    take_swa,
)


class HiRadixCache(TieredRadixTree):
    """Radix tree over token ids with device and host tiers (see the module docstring).

    Args:
        controller: moves rows; a :class:`~hicache.controller.HybridCacheController` makes
            a hybrid tree. Its device allocator's page size is the tree's page size.
        write_policy: when device nodes are backed up to the host.
        write_through_hits: matches before a backup under ``write_through_selective``.
        load_back_threshold_tokens: host-only spans shorter than this are not loaded back.
        eviction_policy: ``lru`` (last access) or ``lfu`` (hit count, then last access).
        window_tokens: the sliding window of a hybrid model (required iff hybrid).
        clock: last-access time source; the default is a counter (deterministic tests).
    """

    def __init__(
        self,
        controller: TransferCore,
        *,
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH_SELECTIVE,
        write_through_hits: int = 2,
        load_back_threshold_tokens: int = 16,
        eviction_policy: EvictionPolicy = EvictionPolicy.LRU,
        window_tokens: int | None = None,
        clock: Clock | None = None,
        keep_swa_history: bool = True,
    ) -> None:
        super().__init__(
            controller, write_policy=write_policy, write_through_hits=write_through_hits,
            eviction_policy=eviction_policy, window_tokens=window_tokens, clock=clock,
            keep_swa_history=keep_swa_history,
        )
        self.window_backups = WindowBackups(self.page_size)
        if load_back_threshold_tokens < 0:
            raise ValueError(
                f"load_back_threshold_tokens must be >= 0, got {load_back_threshold_tokens}"
            )
        self.load_back_threshold_tokens = load_back_threshold_tokens

    # ---- matching and insertion ---------------------------------------------------------

    def match_prefix(self, tokens: TokenIds | TokenKey) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens`` (see :class:`MatchResult`).

        Splits a partly matched node at the page boundary, updates the last access and hit
        count of every matched node and, under ``write_through(_selective)``, backs up the
        device nodes whose hit count reached the threshold. ``tokens`` as for
        :meth:`page_key`, which refuses bad ones (``TypeError``/``ValueError``) first.
        """
        key = self.key_data(tokens, "match")
        path = [node for node, _ in self._descend(key, split=True)]
        now, touched, hits = self._clock(), self._touched, self.backup_hits
        for node in path:
            node.last_access = now
            node.hit_count += 1
            touched[node] = None  # _touch, inlined: per matched node of every request
        if hits is not None:  # write_through (1): every matched node
            self._backup_nodes(path if hits == 1 else [n for n in path if n.hit_count >= hits])
        if self.storage is not None:
            self.storage.matched(path)
        result = self._result(path)
        self.stats.matched_tokens += len(key) // TOKEN_BYTES
        self.stats.device_hit_tokens += result.device_hit_tokens
        self.stats.host_hit_tokens += result.host_hit_tokens
        return result

    def insert(self, tokens: TokenIds | TokenKey, device_indices: Indices) -> int:
        """Cache ``tokens`` whose KV rows the caller wrote at ``device_indices``.

        Args:
            tokens: token ids as for :meth:`page_key`; only whole pages are cached.
            device_indices: ``[>= n]`` CPU ``DEVICE_FULL`` slots aligned with ``tokens``
                (``n`` = whole-page length); the tree takes ``[:n]`` (module docstring).
        Returns:
            how many leading tokens were already cached (on either tier).
        Raises:
            TypeError: tokens that are not token ids (see :meth:`page_key`).
            ValueError: a negative token id; slots of another space or device, too few, or
                not allocated pages.

        A slot the tree owns at another position would be freed as a duplicate: the tree
        does not look for that caller bug (``HiCacheService.insert`` refuses it).
        """
        key = self.key_data(tokens, "insert")
        slots = self.io.take_slots(device_indices, len(key) // TOKEN_BYTES)
        return self.insert_slots(key, slots.tensor.numpy(), 0)

    def insert_slots(self, key: bytes, slots: np.ndarray, own_tokens: int) -> int:
        """:meth:`insert` of key bytes (``TokenKey.data``) and int64 ``slots`` (one a token)
        checked as :meth:`NodeIO.take_slots` does (the service's engine-slot check implies
        it); they may view the engine's tensor (nodes and duplicates get copies).
        ``own_tokens``: leading tokens whose slots the check compared slot for slot with the
        tree's own, nothing changed since (no duplicate among them)."""
        num_tokens = len(key) // TOKEN_BYTES
        if self.io.is_hybrid:  # before any change: no SWA copy of these pages in flight
            refuse_copies_in_flight(self, slots[:num_tokens])
        path, taken, duplicates, cached = self._insert_walk(key, slots, own_tokens)
        duplicate = None
        if duplicates:  # most inserts hand the tree's own pages back: none
            duplicate = cat_indices(duplicates, IndexSpace.DEVICE_FULL)
            self.io.free_device(duplicate)
            self.stats.duplicate_tokens += len(duplicate)
        if self.io.is_hybrid:  # a full-attention model has no SWA rows nor copies of them
            take_swa(self, taken, duplicate, num_tokens)
        self.stats.inserted_tokens += num_tokens - cached
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            self._backup_nodes(path)
        return cached

    def _insert_walk(
        self, key: bytes, given: np.ndarray, own_tokens: int
    ) -> tuple[list[TreeNode], list[tuple[TreeNode, int]], list[Indices], int]:
        """Walk and extend the tree along ``key`` (bytes) with the caller's slots ``given``
        (see :meth:`insert_slots`). Returns the path, the nodes that took caller slots (with
        their token offset), the duplicate slots and the cached length in tokens."""
        now, node, at, cached = self._clock(), self.root, 0, 0  # at: a byte offset
        path: list[TreeNode] = []
        taken: list[tuple[TreeNode, int]] = []
        duplicates: list[Indices] = []
        step, total = self._page_bytes, given.size  # a node keeps a torch copy of its part
        while at < len(key):
            pos = at // TOKEN_BYTES
            child = node.children.get(key[at:at + step])
            if child is None:
                child = self._new_child(node, key[at:], _copy(given, pos, total))
                child.last_access = now
                taken.append((child, pos))
                path.append(child)
                break
            common = self._common_bytes(child.key, key, at) // TOKEN_BYTES
            if common < child.num_tokens:
                child = self._split(child, common)
            if child.device is None:  # re-attach: the host-only node is on the device again
                child.device = _copy(given, pos, pos + common)
                taken.append((child, pos))
            elif pos + common > own_tokens:  # a view: differing_pages returns a copy
                differing = self.io.differing_pages(child.device, given[pos:pos + common])
                if differing is not None:
                    duplicates.append(differing)
            child.last_access = now
            self._touch(child)
            path.append(child)
            cached, at, node = cached + common, at + common * TOKEN_BYTES, child
        return path, taken, duplicates, cached

    # ---- load-back ----------------------------------------------------------------------

    def load_back(self, node: TreeNode, device_quota_tokens: int) -> LoadBack:
        """Queue the load of ``node`` and its host-only ancestors, down from the first
        device-resident ancestor.

        All or nothing: refused (:class:`~hicache.radix.node.Refusal`, also counted by
        reason) when the span is shorter than ``load_back_threshold_tokens``, longer than
        ``device_quota_tokens``, lacks SWA host rows for its window tail (hybrid), or finds
        no device room after one eviction. On success the nodes own their new slots at once
        and ``node`` stays locked until the ack; the rows are valid after
        :meth:`start_loading` and ``wait_until(layer)``.

        Returns:
            a :class:`~hicache.radix.node.LoadBack`: the ``[span]`` CPU ``DEVICE_FULL``
            slots of the loaded tokens (empty when nothing is host-only), or why not.
        """
        return load_back(self, node, device_quota_tokens)

    def back_up_window(self, device: Indices) -> None:
        """Engine-held whole pages that left every future window give back their SWA
        slots: under ``swa_history: all`` their SWA rows are first copied to the host
        (kept for the node that will take the page at ``insert``) and the device SWA slots
        are freed when the copy is acknowledged; otherwise they are freed now. The copy is
        queued: a service issues it with the step's write (one op for every request of the
        step), or sooner when ``insert``, ``free_device`` or an allocation short of SWA
        slots needs it; a tree on its own (``issue_backups``) issues it at once."""
        back_up_window(self, device)

    def evict_swa(self, num_tokens: int) -> int:
        """Free device SWA rows that have a host copy, of unlocked nodes with nothing in
        flight, in the eviction policy's order; the nodes keep their full rows. Returns the
        SWA tokens freed."""
        return evict_swa(self, num_tokens)

    def start_loading(self) -> int | None:
        """Issue the queued load-backs; returns the controller's event set id (or ``None``
        when nothing was queued)."""
        return self.controller.start_loading()

    # ---- acknowledgements and integrity -------------------------------------------------

    def apply_acks(self, acks: Iterable[Ack]) -> None:
        """Apply acks of ops this tree issued: host copies become valid and write-through
        locks drop; write-back evictions free their device slots (unless the node was
        locked or gained device children meanwhile); load-back locks drop."""
        for ack in acks:
            for tag in ack.tags:
                if not isinstance(tag, PendingOp):
                    raise TypeError(f"ack of op {ack.op_id} carries tag {tag!r}, not a tree op")
                if isinstance(tag, WindowBackupOp):
                    finish_window_backup(self, tag)
                elif tag.direction is Direction.DEVICE_TO_HOST:
                    self._finish_write(tag)
                else:
                    self._finish_load(tag)

    def check_integrity(
        self, engine_device: Indices | None = None, *, sync_device: bool = True
    ) -> None:
        """Raise ``RuntimeError`` unless every slot of every tier is free, owned by exactly
        one node, or held by the engine (``engine_device``: ``DEVICE_FULL`` slots allocated
        and not inserted, with their SWA slots); slots in flight must be node-owned; the
        tree's shape, tier invariants and lock counts must be consistent.
        ``sync_device=False`` skips the one check that waits for the GPU (the device copy
        of the hybrid full-to-SWA map)."""
        check_tree(self, engine_device, sync_device)

    # ---- internals ----------------------------------------------------------------------

    def _result(self, path: list[TreeNode]) -> MatchResult:
        parts = []  # the device prefix: the nodes' tensors up to the first not on the device
        for node in path:
            if node.device is None:
                break
            parts.append(node.device.tensor)
        on_device = len(parts)
        host_only = path[on_device:]  # most matches: none (no generator made then)
        assert not host_only or all(n.device is None and n.is_backed_up for n in host_only), \
            "a node below the device prefix has no complete host copy"
        host_tokens = sum(len(n.key) for n in host_only) // TOKEN_BYTES if host_only else 0
        # a new tensor, never a node's: an engine reusing it would rename the node's pages
        device = (Indices(joined(parts), IndexSpace.DEVICE_FULL) if parts  # a copy, even of one
                  else cat_indices([], IndexSpace.DEVICE_FULL))
        return MatchResult(device, path[on_device - 1] if on_device else self.root,
                           path[-1] if path else self.root, host_tokens)


def _copy(slots: np.ndarray, begin: int, end: int) -> Indices:
    """Slots ``[begin, end)`` of int64 ``slots``: a node's own tensor."""
    return Indices(int64_copy(torch.from_numpy(slots[begin:end])), IndexSpace.DEVICE_FULL)
