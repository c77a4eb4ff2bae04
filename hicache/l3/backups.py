"""Backups from the host tier to the shared store: which nodes, when, and what an ack does.

Policies (``storage.write_policy``), applied once a node's host copy is acknowledged:

- ``write_through``: every node, at once;
- ``write_through_selective``: a node matched ``write_through_hits`` times (checked when its
  host copy is acknowledged and when it is matched again);
- ``write_back``: a node only when host eviction picks it; it stays on the host until the
  store has its pages, then leaves.

A put reads the node's host slots on the backup worker; the node carries the put
(``store_op``) until its result is applied, and host eviction passes it by meanwhile. A
node is marked ``in_storage`` only when every page was stored: a failure never claims a
page is in the store. Scheduler thread only (the worker runs :class:`PutJob`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache.config import WritePolicy
from hicache.pools import Indices
from hicache.radix.node import PendingStore, TreeNode
from hicache.storage import PageStatus

from .hashes import RecentHashes, node_page_hashes, split_hashes
from .jobs import PutJob
from .shared_copy import WriteShare
from .stats import FailureLog, PageObserver, StorageTierStats

if TYPE_CHECKING:
    from hicache.radix import HiRadixCache


class StoreBackups:
    """The put side of :class:`hicache.l3.StorageTier`; ``submit`` queues a put on the
    worker (``False`` when refused)."""

    def __init__(self, tree: HiRadixCache, submit: Callable[[PutJob], bool],
                 policy: WritePolicy, hits: int, stats: StorageTierStats,
                 notify: PageObserver, recent: RecentHashes,
                 share: WriteShare | None = None) -> None:
        self.tree = tree
        self.recent = recent  # prefetches' page hashes, for their tokens' nodes
        self.share = share  # a tensor-parallel rank's part of a copy the ranks share
        self.submit = submit
        self.policy = policy
        self.hits = hits
        self.stats = stats
        self.notify = notify
        # host slots (full, aligned SWA) of nodes gone while their put reads them
        self._pending_free: dict[PendingStore, list[tuple[Indices, Indices | None]]] = {}
        self._failures = FailureLog("puts")

    def host_copies_ready(self, nodes: list[TreeNode]) -> None:
        if self.policy is WritePolicy.WRITE_BACK:
            return
        for node in nodes:
            if self.policy is WritePolicy.WRITE_THROUGH or node.hit_count >= self.hits:
                self.put(node, evict_after=False)

    def matched(self, path: list[TreeNode]) -> None:
        if self.policy is not WritePolicy.WRITE_THROUGH_SELECTIVE:
            return
        for node in path:
            if node.hit_count >= self.hits and node.is_backed_up:
                self.put(node, evict_after=False)

    def keep_for_store(self, node: TreeNode) -> bool:
        if self.policy is not WritePolicy.WRITE_BACK or node.in_storage:
            return False
        return self.put(node, evict_after=True)  # counted written back once stored

    def put(self, node: TreeNode, *, evict_after: bool) -> bool:
        """Queue a put of ``node``'s host pages unless stored, in flight or not backed up;
        ``True`` if queued."""
        if node.in_storage or node.store_op is not None or not node.is_backed_up \
                or node.is_detached:
            return False
        assert node.host is not None
        pending = PendingStore([node], evict_after)
        hashes = split_hashes(node_page_hashes(self.tree, node, self.recent))
        host, swa = node.host.tensor, None if node.host_swa is None else node.host_swa.tensor
        if swa is not None:  # hybrid: only pages whose SWA rows are all on the host
            whole = (swa.view(-1, self.tree.page_size) != 0).all(dim=1).numpy()
            self.stats.backup_pages["no_swa_rows"] += int(whole.size - whole.sum())
            hashes, host, swa = self._pages(whole, hashes, host, swa)
            if not hashes:
                node.in_storage = True  # nothing of it can go to the store
                return False
        if self.share is not None:  # the pages this rank writes (it may be none: still a
            # job, held like every rank's, whose result is agreed with theirs)
            hashes, host, swa = self._pages(self.share.written(hashes), hashes, host, swa)
        job = PutJob(pending, hashes, host.clone(), None if swa is None else swa.clone())
        if not self.submit(job):
            self.stats.backup_pages["dropped"] += len(hashes)
            return False
        node.store_op = pending
        self.notify("put", hashes, job.host, job.swa)
        return True

    def _pages(self, kept: np.ndarray, hashes: list[bytes], host: torch.Tensor,
               swa: torch.Tensor | None) -> tuple[list[bytes], torch.Tensor, torch.Tensor | None]:
        """The ``kept`` pages (a bool per page) of a put's hashes and (per token) CPU host
        slots, by numpy's indexing (64 pages: 4 us, where torch's took 11)."""
        if kept.all():
            return hashes, host, swa
        page = self.tree.page_size
        pages = np.flatnonzero(kept)

        def rows(slots: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(slots.numpy().reshape(-1, page)[pages].reshape(-1))

        return ([hashes[i] for i in pages.tolist()], rows(host),
                None if swa is None else rows(swa))

    def free_host_after_store(self, node: TreeNode, host: Indices) -> None:
        assert node.store_op is not None
        self._pending_free.setdefault(node.store_op, []).append((host, node.host_swa))

    def held_slots(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(full, SWA) host slots of gone nodes that wait for their put."""
        return [(host.tensor, None if swa is None else swa.tensor)
                for parts in self._pending_free.values() for host, swa in parts]

    def finish(self, job: PutJob, *, stored_all: bool | None = None) -> None:
        """Apply a put's result: clear the nodes' ``store_op``, mark them stored if every
        page was (``stored_all``: as the tensor-parallel ranks agreed, instead of this
        rank's result), free what waited for it, and finish a write-back's host eviction."""
        assert job.result is not None
        statuses = job.result.statuses
        stored = sum(1 for status in statuses if status is PageStatus.OK)
        if stored_all is None:
            stored_all = stored == len(statuses)
        self.stats.backup_pages["stored"] += stored
        self.stats.backup_pages["failed"] += len(statuses) - stored
        failed = len(statuses) - stored
        self._failures.note(None if not failed else
                            job.result.error or f"{failed} of {len(statuses)} pages not stored")
        pending = job.pending
        tree = self.tree
        for node in pending.nodes:
            if node.store_op is pending:
                node.store_op = None
                node.in_storage = stored_all
                tree._touch(node)
        for host, swa in self._pending_free.pop(pending, []):
            tree.io.free_host(host, swa)
        if pending.evict_after and stored_all:  # written to the store before its eviction
            self.stats.backup_evictions += len(pending.nodes)
        if pending.evict_after:
            # deepest first: a parent becomes a leaf once its child left
            for node in sorted(pending.nodes, key=TreeNode.depth, reverse=True):
                if not node.is_detached and tree._is_host_candidate(node):
                    tree.evict_host_node(node)
