"""Prefetches from the shared store into host slots, and what finishing one does.

A prefetch starts on a match whose uncached tail has at least ``prefetch_threshold_tokens``
of whole pages: one batched query asks the store how many of those pages it has; no host
slot is allocated before the answer. The scheduler thread then allocates host slots for the
pages found (evicting host leaves if needed) and the worker reads them in batches. The
matched node stays locked meanwhile, so the pages have a place to join the tree.

:meth:`Prefetches.finish` gives the tree the pages that arrived (a leading run: a prefetch
never leaves a hole) as host-only nodes; the engine matches again and loads them back like
any host hit. Pages still being read when it finishes are freed once the worker is done
with them. When to finish is the engine's call under the policy (:meth:`Prefetches.ready`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hicache.config.storage import PrefetchPolicy, StorageConfig
from hicache.pools import IndexSpace, Indices
from hicache.radix.host_run import attach_host_run
from hicache.radix.key import TOKEN_BYTES
from hicache.radix.node import MatchResult, TreeNode
from hicache.storage import PageStatus
from hicache.storage.keys import PAGE_HASH_BYTES

from .hashes import RecentHashes, last_hash
from .jobs import PrefetchJob, PrefetchPhase
from .stats import FailureLog, PageObserver, StorageTierStats

if TYPE_CHECKING:
    from hicache.radix import HiRadixCache

BATCH_PAGES = 16  # pages per store read: what a best-effort finish can use at the least

_STATUS_OUTCOME = {PageStatus.MISS: "not_found", PageStatus.CORRUPT: "corrupt",
                   PageStatus.TIMEOUT: "timeout", PageStatus.ERROR: "error"}

_FAILED = (PageStatus.TIMEOUT, PageStatus.ERROR)


def _store_failure(job: PrefetchJob) -> str | None:
    """Why the store failed ``job``'s calls (its message), ``None`` if it answered them all
    (misses and corrupt pages are answers)."""
    failed = job.missing in _FAILED or any(status in _FAILED for status in job.statuses)
    return job.error or ("the store's deadline passed" if failed else None)


@dataclass(eq=False)
class Prefetch:
    """A prefetch in progress, for one request (from ``HiCacheService.prefetch``).

    ``num_tokens``: whole-page tokens asked for. ``found_tokens``: how many the store has
    (``None`` until it answered). Pass it to ``prefetch_ready``, ``wait_prefetch`` and, once,
    ``finish_prefetch``.
    """

    node: TreeNode
    key: bytes
    job: PrefetchJob
    deadline: float | None
    finished: bool = False
    timed_out: bool = False  # a tensor-parallel rank's: every rank's deadline passed

    @property
    def num_tokens(self) -> int:
        """Whole-page tokens this prefetch asked of the store."""
        return len(self.key) // TOKEN_BYTES

    @property
    def found_tokens(self) -> int | None:
        """Tokens the store holds of them, in order from the first; ``None`` until known."""
        if self.job.phase is PrefetchPhase.QUERY or self.job.held_stage is PrefetchPhase.QUERY:
            return None
        return self.job.found * self.job.page_size


class Prefetches:
    """The prefetch side of :class:`hicache.l3.StorageTier`.

    ``submit`` queues a job on the worker (``False`` when refused); ``agreed``: a
    tensor-parallel rank's, whose jobs are applied where the ranks agree
    (:mod:`hicache.l3.held_jobs`).
    """

    def __init__(self, tree: HiRadixCache, submit: Callable[[PrefetchJob], bool],
                 config: StorageConfig, stats: StorageTierStats, notify: PageObserver,
                 recent: RecentHashes, *, agreed: bool = False) -> None:
        self.tree = tree
        self.recent = recent  # prefetches' page hashes, for their tokens' nodes
        self.submit = submit
        self.agreed = agreed
        self.config = config
        self.threshold_tokens = config.prefetch_threshold_tokens
        self.stats = stats
        self.notify = notify
        self.page_size = tree.page_size
        self._active: dict[PrefetchJob, Prefetch] = {}
        # finished early: (full, SWA) slots freed when the job is back
        self._abandoned: dict[PrefetchJob, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._failures = FailureLog("prefetch reads")

    def start(self, key: bytes, match: MatchResult) -> Prefetch | None:
        """Start a prefetch of ``key``'s pages after ``match``; ``None`` when the tail is
        shorter than the threshold, or the queue is full (counted)."""
        cached = match.device_hit_tokens + match.host_hit_tokens
        tail = key[cached * TOKEN_BYTES:]
        num_tokens = len(tail) // TOKEN_BYTES
        if num_tokens < max(self.threshold_tokens, self.page_size):
            return None
        node = match.last_host_node
        # the tail's hashes are the worker's to compute: only the page before is needed now
        job = PrefetchJob(tail, last_hash(self.tree, node, self.recent), self.page_size,
                          BATCH_PAGES)
        if not self.submit(job):
            self.stats.prefetch_tokens["queue_full"] += num_tokens
            return None
        self.recent.add(job)  # its hashes, once the query made them, for the tail's node
        if node is not self.tree.root:
            self.tree.lock(node)
        now = time.monotonic()
        prefetch = Prefetch(node, tail, job, self._deadline(now, num_tokens))
        self._active[job] = prefetch
        self.stats.prefetches += 1
        self.stats.queried_tokens += num_tokens
        return prefetch

    def owns(self, prefetch: Prefetch) -> bool:
        """Whether ``prefetch`` is one of this tier's open prefetches."""
        return self._active.get(prefetch.job) is prefetch

    def ready(self, prefetch: Prefetch) -> bool:
        """Whether the policy says finish it now."""
        if self.config.prefetch_policy is PrefetchPolicy.BEST_EFFORT or \
                self.agreed_done(prefetch.job):
            return True
        return prefetch.timed_out if self.agreed else self.deadline_passed(prefetch)

    def agreed_done(self, job: PrefetchJob) -> bool:
        """Whether ``job`` will read nothing more (on every rank, for an agreed tier)."""
        return job.phase is PrefetchPhase.DONE and job.held_stage is None

    @staticmethod
    def deadline_passed(prefetch: Prefetch) -> bool:
        """Whether this rank's clock passed ``prefetch``'s deadline (``timeout`` policy)."""
        return prefetch.deadline is not None and time.monotonic() >= prefetch.deadline

    def advance(self, job: PrefetchJob) -> None:
        """A job came back from the worker: load what the store has, or free what an
        early finish left behind."""
        if job in self._abandoned:
            self._free(*self._abandoned.pop(job))
            return
        if job.phase is not PrefetchPhase.ANSWERED or job not in self._active:
            return  # loaded (finish takes it), or finished early before the answer
        self.stats.found_tokens += job.found * self.page_size
        if job.cancelled:  # the service is stopping: nothing more is read
            job.phase = PrefetchPhase.DONE
            return
        num_tokens = job.found * self.page_size
        slots = self._alloc(num_tokens)
        if slots is None:
            job.phase, job.unread = PrefetchPhase.DONE, "host_full"  # nothing read
            return
        job.host, job.swa = slots
        job.phase, job.done = PrefetchPhase.LOAD, False
        job.changed.clear()
        if not self.submit(job):
            self._free(*slots)
            job.host, job.swa, job.done, job.phase = None, None, True, PrefetchPhase.DONE
            job.unread = "queue_full"

    def _alloc(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Host slots (and SWA host slots, hybrid) of ``num_tokens``, evicting host leaves
        once if needed; ``None`` when there is no room."""
        io = self.tree.io
        for attempt in range(2):
            full = io.controller.host_pool.allocator.try_alloc(num_tokens)
            swa = None
            if full is not None and io.is_hybrid:
                swa = io.try_alloc_host_swa(num_tokens)
                if swa is None:
                    io.free_host(full, None)
                    full = None
            if full is not None:
                return full.tensor, None if swa is None else swa.tensor
            if attempt == 0 and self.tree.evict_host(num_tokens) == 0:
                return None
        return None

    def finish(self, prefetch: Prefetch) -> int:
        """Give the tree what arrived, unlock, count every page's outcome; tokens attached."""
        if prefetch.finished:
            raise ValueError("finish_prefetch: this prefetch was finished already")
        prefetch.finished = True
        job, page = prefetch.job, self.page_size
        del self._active[job]
        job.cancelled = True
        arrived = job.arrived if not self.agreed else job.agreed_arrived or 0
        attached = 0
        cut = arrived * page
        if arrived:
            assert job.host is not None and job.joined is not None
            host = Indices(job.host[:cut], IndexSpace.HOST_FULL)
            swa = None if job.swa is None else Indices(job.swa[:cut], IndexSpace.HOST_SWA)
            self.notify("arrive", job.hashes[:arrived], host.tensor,
                        None if swa is None else swa.tensor)
            attached, duplicate, duplicate_swa = attach_host_run(
                self.tree, prefetch.node, prefetch.key[:cut * TOKEN_BYTES],
                job.joined[:arrived * PAGE_HASH_BYTES], host, swa)
            self._free(duplicate.tensor, None if duplicate_swa is None else duplicate_swa.tensor)
            self.stats.prefetch_tokens["used"] += attached
            self.stats.prefetch_tokens["cached"] += len(duplicate)
        self._count_rest(prefetch, arrived)
        if job.phase is not PrefetchPhase.QUERY:  # else the store has not answered yet
            self._failures.note(_store_failure(job))
        if job.host is not None and len(job.host) > cut:
            rest = (job.host[cut:], None if job.swa is None else job.swa[cut:])
            if job.done and job.held_stage is None:
                self._free(*rest)
            else:
                self._abandoned[job] = rest  # still being read into: freed when back
        if prefetch.node is not self.tree.root and not prefetch.node.is_detached:
            self.tree.unlock(prefetch.node)
        return attached

    def cancel_all(self) -> None:
        """The service stops: every open prefetch reads no more pages (the worker stops after
        its current batch), and what it never read counts as ``cancelled``."""
        for prefetch in self._active.values():
            prefetch.job.unread = "cancelled"
            prefetch.job.cancelled = True

    def open_prefetches(self) -> list[Prefetch]:
        """Prefetches started and not finished yet."""
        return list(self._active.values())

    def held_slots(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(full, SWA) host slots held outside the tree: prefetches being read, and what
        early finishes left to the worker."""
        held = [(p.job.host, p.job.swa) for p in self._active.values()
                if p.job.host is not None]
        return held + list(self._abandoned.values())

    def _count_rest(self, prefetch: Prefetch, arrived: int) -> None:
        """Outcomes of the pages after the ``arrived`` ones: read after the finish, ``timeout``;
        from the first page the read failed on (a miss, a corrupt page, an error), each
        failed page its own, and the other found pages ``after_failure`` (read or not, the
        prefix ends at that gap); never read otherwise, why (``cancelled``, else
        ``timeout``)."""
        job, page, counts = prefetch.job, self.page_size, self.stats.prefetch_tokens
        total = job.num_pages
        if job.phase is PrefetchPhase.QUERY:
            counts["timeout"] += (total - arrived) * page
            return
        later = list(job.statuses)[arrived:]  # one snapshot: the worker may extend the list
        failed = next((n for n, status in enumerate(later) if status is not PageStatus.OK), None)
        if failed is not None:
            if failed:
                counts["timeout"] += failed * page
            for status in later[failed:]:
                counts[_STATUS_OUTCOME.get(status, "after_failure")] += page
            if job.found > arrived + len(later):
                counts["after_failure"] += (job.found - arrived - len(later)) * page
        else:
            if later:
                counts["timeout"] += len(later) * page
            unread = job.found - arrived - len(later)
            if unread > 0:
                counts[job.unread or "timeout"] += unread * page
        counts[_STATUS_OUTCOME.get(job.missing, "error")] += (total - job.found) * page

    def _deadline(self, now: float, num_tokens: int) -> float | None:
        config = self.config
        if config.prefetch_policy is not PrefetchPolicy.TIMEOUT:
            return None
        return now + config.prefetch_timeout_for(num_tokens)

    def _free(self, host: torch.Tensor, swa: torch.Tensor | None) -> None:
        if len(host):
            self.tree.io.free_host(Indices(host, IndexSpace.HOST_FULL),
                                   None if swa is None else Indices(swa, IndexSpace.HOST_SWA))

