"""What the tree tells the shared-store tier (L3), when the service has one.

The tree calls these on the scheduler thread at the moments that matter to the store:
host copies became valid, nodes were matched (hit counts for selective backups), a host
leaf is about to leave (a write-back stores it first), host slots are freed while a put
still reads them. :class:`hicache.l3.StorageTier` implements them; a tree without a store
has ``storage = None`` and pays one attribute test per call.
"""

from __future__ import annotations

from typing import Protocol

from hicache.pools import Indices

from .node import TreeNode


class StorageHooks(Protocol):
    def host_copies_ready(self, nodes: list[TreeNode]) -> None:
        """The host copies of ``nodes`` were acknowledged (a backup may follow)."""

    def matched(self, path: list[TreeNode]) -> None:
        """``path`` was matched; its hit counts went up."""

    def keep_for_store(self, node: TreeNode) -> bool:
        """Host eviction picked ``node``: ``True`` if it stays until the store has its pages
        (a write-back was queued), ``False`` to evict it now."""

    def free_host_after_store(self, node: TreeNode, host: Indices) -> None:
        """``node`` leaves the tree while a put reads ``host`` (its host slots): free them
        when the put is done."""

    def held_host_slots(self) -> Indices | None:
        """``HOST_FULL`` slots the tier holds outside any node (prefetches, pending frees)."""

    def held_host_swa_slots(self) -> Indices | None:
        """``HOST_SWA`` slots the tier holds outside any node (hybrid models)."""
