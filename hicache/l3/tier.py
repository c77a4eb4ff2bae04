"""StorageTier: the shared store (L3) below the host tier, on the cache's side.

It owns two :class:`~hicache.l3.worker.StorageWorker` threads (prefetches and backups, so a
burst of backups never delays a request's prefetch), :class:`~hicache.l3.prefetches.Prefetches`
and :class:`~hicache.l3.backups.StoreBackups`, and is the tree's
:class:`~hicache.radix.storage_hooks.StorageHooks`. Host memory is the store's staging
area: pages go to the store from host slots after their host backup, and come back into
host slots before a load-back brings them to the device.

Threads: every method runs on the scheduler thread under the service lock (the service
calls them), except that the workers run jobs; :meth:`poll` applies what they finished.
The scheduler never waits on the store: :meth:`wait` (the engine's choice, for
``wait_complete`` or a synchronous engine) waits without the service lock.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hicache.config.storage import StorageConfig
from hicache.controller import HybridCacheController
from hicache.pools import IndexSpace, Indices
from hicache.radix.node import MatchResult, TreeNode, cat_indices
from hicache.storage import StorageBackend

from .backups import StoreBackups
from .hashes import RecentHashes
from .held_jobs import HeldJobs, StoreRound
from .jobs import PrefetchJob, PutJob
from .page_buffers import HostPools
from .prefetches import Prefetch, Prefetches
from .shared_copy import WriteShare
from .stats import PageObserver, StorageTierStats
from .worker import StorageWorker

if TYPE_CHECKING:
    from hicache.radix import HiRadixCache

logger = logging.getLogger(__name__)

MAX_QUEUED_PREFETCHES = 256
MAX_QUEUED_BACKUPS = 1024


class StorageTier:
    """See the module docstring.

    Args:
        tree: the cache; a hybrid model's pages go to the store with their SWA rows.
        store: the shared store, opened for this config's namespace; closed by :meth:`close`.
        config: the ``storage`` section (policies, timeouts).
        agreed: a tensor-parallel rank's tier: its jobs are applied only where the ranks
            agree (:mod:`hicache.l3.held_jobs`; :attr:`held`), at the service's ``step``.
        share: on such a rank, the pages it writes of a copy the ranks share
            (:mod:`hicache.l3.shared_copy`); ``None``: every page it backs up.
    """

    def __init__(self, tree: HiRadixCache, store: StorageBackend, config: StorageConfig, *,
                 agreed: bool = False, share: WriteShare | None = None) -> None:
        if share is not None and not agreed:
            raise ValueError("StorageTier: a share of the writes needs agreed=True (the "
                             "ranks agree on each put's result)")
        self.tree = tree
        self.store = store
        self.config = config
        self.stats = StorageTierStats()
        self.observers: list[PageObserver] = []  # pages stored and arrived (audits, tests)
        controller = tree.io.controller
        pools = HostPools(controller.host_pool,
                          controller.host_swa if isinstance(controller, HybridCacheController)
                          else None)
        self.prefetch_worker = StorageWorker("hicache-l3-prefetch", store, pools,
                                             MAX_QUEUED_PREFETCHES)
        self.backup_worker = StorageWorker("hicache-l3-backup", store, pools,
                                           MAX_QUEUED_BACKUPS)
        self.held = HeldJobs(self.prefetch_worker, self.backup_worker,
                             max_prefetches=MAX_QUEUED_PREFETCHES,
                             max_puts=MAX_QUEUED_BACKUPS) if agreed else None
        held = self.held
        recent = RecentHashes(tree.page_size)  # a prefetch's hashes, for its tokens' backup
        self.prefetches = Prefetches(
            tree, self.prefetch_worker.submit if held is None else held.submit_prefetch,
            config, self.stats, self._notify, recent, agreed=agreed)
        self.backups = StoreBackups(
            tree, self.backup_worker.submit if held is None else held.submit_put,
            config.write_policy, config.write_through_hits, self.stats, self._notify, recent,
            share)
        self._closed = False
        tree.storage = self

    # ---- the engine's calls (through the service) ---------------------------------------

    def start_prefetch(self, key: bytes, match: MatchResult) -> Prefetch | None:
        # no poll first: applying a write-back could evict the matched node
        return self.prefetches.start(key, match)

    def owns(self, prefetch: Prefetch) -> bool:
        """Whether ``prefetch`` is open here (this service's ``prefetch`` made it)."""
        return self.prefetches.owns(prefetch)

    def ready(self, prefetch: Prefetch) -> bool:
        self.poll()
        return self.prefetches.ready(prefetch)

    def finish(self, prefetch: Prefetch) -> int:
        self.poll()
        return self.prefetches.finish(prefetch)

    def wait_for_change(self, prefetch: Prefetch, timeout_s: float) -> None:
        """Block (no lock held) until ``prefetch``'s job changes phase or ``timeout_s``."""
        prefetch.job.changed.wait(timeout_s)

    def poll(self) -> int:
        """Apply the jobs the workers finished; returns how many (none on an agreed tier:
        its step applies them, :meth:`apply_round`)."""
        jobs = self.backup_worker.finished() + self.prefetch_worker.finished()
        self.stats.worker_errors = self.prefetch_worker.errors + self.backup_worker.errors
        if self.held is not None:
            return 0
        for job in jobs:
            if isinstance(job, PutJob):
                self.backups.finish(job)
            else:
                assert isinstance(job, PrefetchJob)
                self.prefetches.advance(job)
        return len(jobs)

    @property
    def write_share_ranks(self) -> int:
        """Ranks that split the writes of one copy in the store (:mod:`.shared_copy`); 0
        when this rank writes every page it backs up."""
        share = self.backups.share
        return 0 if share is None else share.size

    @property
    def queue_depths(self) -> dict[str, int]:
        return {"prefetch": self.prefetch_worker.depth, "backup": self.backup_worker.depth}

    # ---- a tensor-parallel rank's step (hicache.rank_agreement.agreed_step) ---------------

    def round(self, puts_back: int) -> StoreRound:
        """This rank's values for the step's second collective (:meth:`HeldJobs.round`)."""
        assert self.held is not None
        return self.held.round(puts_back, self.prefetches)

    def apply_round(self, round_: StoreRound, agreed: list[int]) -> None:
        """Apply what the ranks agreed on ``round_``."""
        assert self.held is not None
        self.held.apply(round_, agreed, self.backups, self.prefetches)

    def close(self) -> None:
        """Finish every prefetch (what arrived is kept), let queued backups run, stop the
        threads, apply what they finished, and close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.prefetches.cancel_all()
        self.prefetch_worker.close()
        self.backup_worker.close()
        self.poll()
        if self.held is not None:  # every job is back: each rank's own results now
            self.held.apply_all(self.backups, self.prefetches)
        for prefetch in self.prefetches.open_prefetches():
            self.prefetches.finish(prefetch)
        self.tree.storage = None
        self.store.close()

    def _notify(self, event: str, hashes: list[bytes], host: torch.Tensor,
                swa: torch.Tensor | None) -> None:
        for observer in self.observers:
            observer(event, hashes, host, swa)

    # ---- StorageHooks (the tree's calls) ------------------------------------------------

    def host_copies_ready(self, nodes: list[TreeNode]) -> None:
        self.backups.host_copies_ready(nodes)

    def matched(self, path: list[TreeNode]) -> None:
        self.backups.matched(path)

    def keep_for_store(self, node: TreeNode) -> bool:
        return self.backups.keep_for_store(node)

    def free_host_after_store(self, node: TreeNode, host: Indices) -> None:
        self.backups.free_host_after_store(node, host)

    def held_host_slots(self) -> Indices | None:
        held = self.prefetches.held_slots() + self.backups.held_slots()
        full = [Indices(host, IndexSpace.HOST_FULL) for host, _ in held]
        return cat_indices(full, IndexSpace.HOST_FULL) if full else None

    def held_host_swa_slots(self) -> Indices | None:
        held = self.prefetches.held_slots() + self.backups.held_slots()
        swa = [Indices(s[s != 0], IndexSpace.HOST_SWA) for _, s in held if s is not None]
        return cat_indices(swa, IndexSpace.HOST_SWA) if swa else None
