"""Nodes, results and counters of the hierarchical radix tree (:mod:`hicache.radix`).

A :class:`TreeNode` covers a run of whole pages of token ids and owns, aligned token by token
with its key, the slots that hold their KV rows on each tier:

    device       ``DEVICE_FULL`` slots, or ``None`` when evicted from the device
    host         ``HOST_FULL`` slots, or ``None`` when never backed up (or dropped)
    device_swa   ``DEVICE_SWA`` slots (hybrid models; 0 for tokens outside the window tail)
    host_swa     ``HOST_SWA`` slots (hybrid models; 0 for tokens without an SWA backup)

All four are CPU int64 :class:`~hicache.pools.Indices` of ``len(key)`` entries, so a split at
a page boundary slices every one of them at the same offset. Bookkeeping only: nothing here
touches a stream.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hicache.controller import Direction, Event
from hicache.pools import IndexSpace, Indices
from hicache.pools.serial_copies import int64_copy, joined

from .key import TOKEN_BYTES, key_tokens

# The slot fields of a node, sliced together on a split and walked by the integrity check.
SLOT_FIELDS: tuple[str, ...] = ("device", "host", "device_swa", "host_swa")


@dataclass(eq=False)
class PendingOp:
    """The tree's record of one controller op it issued; the op's ack carries it as its tag.

    ``nodes`` grows when a node in flight is split (both halves wait for the same ack).
    ``locks``: the nodes locked until the ack, one lock each (a write-through backup's
    node, a load-back's last node; several for the backups of one step issued as one op),
    or none (write-back evictions, which flag their nodes with ``evict_on_ack`` instead).
    ``queued``: a backup that ``insert`` or ``match`` queued and the tree has not issued
    yet; its nodes are on the device and locked, with no host slots until it is issued
    (:meth:`~hicache.radix.tiers.TieredRadixTree.issue_queued_backups`). ``marks``: events
    recorded on the streams current where it was queued, which its copy waits on (CUDA).
    """

    direction: Direction
    nodes: list[TreeNode]
    locks: list[TreeNode]
    queued: bool = False
    marks: tuple[Event, ...] = ()


@dataclass(eq=False)
class PendingStore:
    """A put of nodes' host pages into the shared store, in flight on a storage worker.

    ``nodes`` grows when a node in flight is split (both halves wait for the same job);
    ``evict_after``: the put is a write-back on host eviction, and the nodes leave the
    host once it is done."""

    nodes: list[TreeNode]
    evict_after: bool = False


@dataclass(eq=False)
class TreeNode:
    """One radix-tree node; see the module docstring for the slot fields.

    ``tree_id`` names the tree that made the node, so a tree refuses (in O(1)) a node of
    another one. ``lock_count`` counts locks held on this node or any descendant (locks
    propagate to the ancestors), so a node with ``lock_count > 0`` is never evicted;
    ``caller_locks`` counts those of them the engine took on this node itself.
    ``write_op`` / ``load_op`` are set while a backup / load-back of this node's slots is in
    flight. ``is_detached`` is set when the node leaves the tree (evicted from the host, or
    dropped); such a node is never locked or loaded again.
    """

    node_id: int
    key: bytes  # whole pages of token ids (hicache.radix.key.key_bytes)
    parent: TreeNode | None
    tree_id: int
    children: dict[bytes, TreeNode] = field(default_factory=dict)
    device: Indices | None = None
    host: Indices | None = None
    device_swa: Indices | None = None
    host_swa: Indices | None = None
    lock_count: int = 0
    caller_locks: int = 0  # the engine's own locks of this node (service.lock)
    hit_count: int = 0
    last_access: float = 0.0
    write_op: PendingOp | None = None
    load_op: PendingOp | None = None
    evict_on_ack: bool = False
    is_detached: bool = False
    # the shared store (L3), when the service has one (hicache.l3):
    page_hashes: bytes | None = None  # the chained hash of each page, 32 bytes each
    store_op: PendingStore | None = None  # a put reading this node's host slots
    # nothing more of it to store: every page it could send was stored (a store may evict
    # it since); a hybrid page without all its SWA rows on the host is never sent
    in_storage: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens of this node's key (whole pages)."""
        return len(self.key) // TOKEN_BYTES

    @property
    def tokens(self) -> tuple[int, ...]:
        """The token ids of this node's key (for debugging and tests: it decodes them)."""
        return key_tokens(self.key)

    @property
    def on_device(self) -> bool:
        """True while the node holds device slots."""
        return self.device is not None

    @property
    def is_backed_up(self) -> bool:
        """True when the host copy is complete (allocated and its write acknowledged)."""
        return self.host is not None and self.write_op is None

    @property
    def is_host_only(self) -> bool:
        """True when the node has a host copy and no device slots."""
        return self.device is None and self.host is not None

    @property
    def is_in_flight(self) -> bool:
        """True while a backup or a load of the node is not acknowledged."""
        return self.write_op is not None or self.load_op is not None

    def has_device_child(self) -> bool:
        """True when a child of the node holds device slots."""
        return any(child.device is not None for child in self.children.values())

    def depth(self) -> int:
        """Nodes between this one and the root (the root's children have depth 1)."""
        depth, node = 0, self.parent
        while node is not None:
            depth, node = depth + 1, node.parent
        return depth

    def __repr__(self) -> str:
        tiers = "".join(tag for tag, on in (("D", self.on_device), ("H", self.host is not None))
                        if on) or "-"
        return f"TreeNode(id={self.node_id}, tokens={self.num_tokens}, tiers={tiers}, " \
               f"locks={self.lock_count})"


class MatchResult(NamedTuple):
    """What :meth:`HiRadixCache.match_prefix` found for a token sequence.

    ``device_indices``: ``[d]`` CPU int64 ``DEVICE_FULL`` slots of the device-resident prefix
    (``d`` a page multiple). ``last_device_node``: the deepest matched node on the device (the
    root when ``d == 0``); lock it to keep ``device_indices`` valid. ``last_host_node``: the
    deepest matched node (equal to ``last_device_node`` when nothing is host-only); pass it
    to ``load_back``. ``host_hit_tokens``: tokens after the device prefix held only on the host.
    """

    device_indices: Indices
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_tokens: int

    @property
    def device_hit_tokens(self) -> int:
        """Tokens of the match found on the device (the length of ``device_indices``)."""
        return len(self.device_indices)


class Refusal(enum.Enum):
    """Why a load-back was refused (the ``refused_load_backs`` counters use the values)."""

    BELOW_THRESHOLD = "below_threshold"  # a host run shorter than load_back_threshold_tokens
    OVER_QUOTA = "over_quota"  # longer than the caller's device_quota_tokens
    SWA_TAIL_MISSING = "swa_tail_missing"  # the window's SWA rows are on no tier
    DEVICE_FULL = "device_full"  # no device room, even after one eviction: retry later


class LoadBack(NamedTuple):
    """What :meth:`HiRadixCache.load_back` did.

    ``device_indices``: ``[n]`` CPU int64 ``DEVICE_FULL`` slots of the loaded host run, valid
    after ``start_loading`` and ``wait_until(layer)`` (empty when nothing was host-only, or
    when refused). ``refused``: ``None`` when queued (or nothing needed loading), else why
    not; nothing was allocated or locked then. ``num_tokens``: tokens of the host run.
    ``restored_swa_tokens``: device-prefix tokens whose window SWA rows the op restores
    (hybrid models).
    """

    device_indices: Indices
    refused: Refusal | None
    num_tokens: int
    restored_swa_tokens: int = 0

    @property
    def queued(self) -> bool:
        """True unless refused: the prefix is usable once the op's layers arrived."""
        return self.refused is None


# the reasons ``CacheStats.refused_backups`` counts (the metrics export each from the start)
BACKUP_REFUSALS: tuple[str, ...] = ("host_full", "host_swa_full")


@dataclass
class CacheStats:
    """Cumulative tree counters in tokens (plain numbers; ``hicache.metrics`` exports them).

    ``dropped_tokens``, ``refused_load_backs`` and ``refused_backups`` count the tokens
    concerned, keyed by reason: ``no_backup`` (a device
    node evicted before any backup), ``host_full`` (the host had no room), ``orphaned`` (host
    copies below a dropped node), ``below_threshold``, ``over_quota``, ``device_full``,
    ``swa_tail_missing``, ``host_swa_full``. SWA counters (hybrid models):
    ``window_backup_tokens`` (SWA rows of engine-held pages copied to the host when they
    left the window), ``restored_swa_tokens`` (SWA rows a load-back brought back for the
    device prefix), ``evicted_swa_tokens`` (device SWA rows freed on their own),
    ``evicted_host_swa_tokens`` (host SWA copies freed on their own, the full rows kept).
    """

    matched_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    inserted_tokens: int = 0
    duplicate_tokens: int = 0
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    loaded_back_tokens: int = 0
    backed_up_tokens: int = 0
    window_backup_tokens: int = 0
    restored_swa_tokens: int = 0
    evicted_swa_tokens: int = 0
    evicted_host_swa_tokens: int = 0
    dropped_tokens: Counter[str] = field(default_factory=Counter)
    refused_load_backs: Counter[str] = field(default_factory=Counter)
    refused_backups: Counter[str] = field(default_factory=Counter)


def empty_indices(space: IndexSpace) -> Indices:
    """``[0]`` CPU int64 indices of ``space``."""
    return Indices(torch.empty(0, dtype=torch.int64), space)


def cat_indices(parts: list[Indices], space: IndexSpace) -> Indices:
    """Concatenate ``parts`` (all of ``space``) into one CPU int64 :class:`Indices`."""
    if not parts:
        return empty_indices(space)
    if len(parts) == 1:
        return parts[0]
    return Indices(joined([part.tensor for part in parts]), space)


def slice_indices(indices: Indices, begin: int, end: int) -> Indices:
    """Tokens ``[begin, end)`` of ``indices`` as a copy (a node never shares a tensor)."""
    return Indices(int64_copy(indices.tensor[begin:end]), indices.space)
