"""Store jobs of a tensor-parallel rank, applied only where every rank agrees on them.

Ranks that serve the same requests make the same calls, so they submit the same store jobs
in the same order; but each rank's store answers on its own schedule and may answer
differently (a page one rank's store lost, a timeout on one rank). Whatever a job's result
changes in the tree (a prefetch's host slots and pages, a put's ``in_storage`` and the host
eviction that waited for it) must change it on every rank at the same step, with the same
values, or the ranks' matches part. So on a rank (:class:`HeldJobs`):

- a job submitted stays *held* until the ranks agree it is back on every rank; nothing a
  worker finished is applied when it finishes;
- a worker's queue is full when the jobs held for it reach its limit: a count every rank
  has, where the queue's own depth is each rank's timing;
- at each ``step()`` (:func:`hicache.rank_agreement.agreed_step`) the ranks agree, with the
  minimum over ranks, on how many leading puts are back, then (a second collective, of a
  length every rank knows) on each of those puts' success, on each held prefetch job's
  progress (back or not; pages found by a query, pages arrived by a load) and on which
  open prefetches passed their deadline (``timeout`` policy). A query's pages are the
  fewest any rank's store found; a load's, the fewest any rank read; a put stored a node
  only if it did on every rank.

:meth:`Prefetches.ready <hicache.l3.prefetches.Prefetches.ready>`,
``found_tokens`` and ``finish`` read only agreed values. At ``stop`` every job is back on
every rank and is applied with the rank's own values (nothing is served after that).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hicache.config.storage import PrefetchPolicy
from hicache.storage import PageStatus, StorageResult

from .jobs import PrefetchJob, PrefetchPhase, PutJob
from .worker import StorageWorker

if TYPE_CHECKING:
    from .backups import StoreBackups
    from .prefetches import Prefetch, Prefetches


@dataclass(eq=False)
class StoreRound:
    """One step's view of the held jobs, taken before the collective: the agreed number of
    leading puts back, the prefetch jobs held and the open prefetches whose deadline is
    agreed on, with this rank's values for them (:meth:`HeldJobs.round`)."""

    puts: list[PutJob]
    prefetch_jobs: list[PrefetchJob]
    timing: list[Prefetch]
    values: list[int] = field(default_factory=list)


class HeldJobs:
    """The store jobs this rank submitted and the ranks have not agreed back yet.

    Args:
        prefetch_worker, backup_worker: the tier's workers.
        max_prefetches, max_puts: jobs held at most for each (more are refused, counted
            by the caller as ``queue_full`` or ``dropped``).
    """

    def __init__(self, prefetch_worker: StorageWorker, backup_worker: StorageWorker, *,
                 max_prefetches: int, max_puts: int) -> None:
        self._prefetch_worker = prefetch_worker
        self._backup_worker = backup_worker
        self._max_prefetches = max_prefetches
        self._max_puts = max_puts
        self.puts: collections.deque[PutJob] = collections.deque()  # submission order
        self.prefetch_jobs: list[PrefetchJob] = []  # submission order

    def submit_put(self, job: PutJob) -> bool:
        """Queue ``job`` on the backup worker; ``False`` when the held puts reach the limit
        (or the worker closed). A put of no pages (another rank writes them all,
        :mod:`hicache.l3.shared_copy`) is back at once, held like the others."""
        if len(self.puts) >= self._max_puts or self._backup_worker.closed:
            return False
        if not job.hashes:
            job.result, job.done = StorageResult(()), True
        elif not self._backup_worker.submit(job):
            return False
        self.puts.append(job)
        return True

    def submit_prefetch(self, job: PrefetchJob) -> bool:
        """Queue ``job`` (a query or a load) on the prefetch worker; ``False`` as above."""
        if len(self.prefetch_jobs) >= self._max_prefetches:
            return False
        stage = job.phase  # before the worker can change it
        if not self._prefetch_worker.submit(job):
            return False
        job.held_stage = stage
        self.prefetch_jobs.append(job)
        return True

    @property
    def num_held(self) -> int:
        return len(self.puts) + len(self.prefetch_jobs)

    def leading_puts_back(self) -> int:
        """Puts back from the worker before the first still queued or running (they finish
        in the order submitted, on one thread)."""
        count = 0
        for put in self.puts:
            if not put.done:
                break
            count += 1
        return count

    def round(self, puts_back: int, prefetches: Prefetches) -> StoreRound:
        """This rank's values for a step's second collective, once the ranks agreed that
        ``puts_back`` leading puts are back on all of them: 1 for each of those stored
        whole; back (0/1) and pages (found or arrived) for each held prefetch job; for a
        ``timeout`` policy, 1 for each prefetch not done whose deadline passed here."""
        round_ = StoreRound([self.puts[i] for i in range(puts_back)], list(self.prefetch_jobs),
                            [])
        values = round_.values
        for put in round_.puts:
            assert put.result is not None
            values.append(int(all(status is PageStatus.OK for status in put.result.statuses)))
        # a query's pages count once every rank is back; a load's arrived pages are final
        for job in round_.prefetch_jobs:
            values += (int(job.done),
                       job.found if job.held_stage is PrefetchPhase.QUERY else job.arrived)
        if prefetches.config.prefetch_policy is PrefetchPolicy.TIMEOUT:
            round_.timing = [p for p in prefetches.open_prefetches()
                             if not p.timed_out and not prefetches.agreed_done(p.job)]
            values += (int(prefetches.deadline_passed(p)) for p in round_.timing)
        return round_

    def apply(self, round_: StoreRound, agreed: list[int], backups: StoreBackups,
              prefetches: Prefetches) -> None:
        """Apply what the ranks agreed on (``agreed``: the minimum over ranks of each of
        ``round_.values``), in submission order."""
        at = 0
        for put in round_.puts:
            assert self.puts[0] is put
            self.puts.popleft()
            backups.finish(put, stored_all=bool(agreed[at]))
            at += 1
        back: list[tuple[PrefetchJob, int]] = []
        for job in round_.prefetch_jobs:
            is_back, pages = agreed[at], agreed[at + 1]
            at += 2
            if is_back:
                back.append((job, pages))
            elif job.held_stage is PrefetchPhase.LOAD:
                job.agreed_arrived = max(job.agreed_arrived or 0, pages)
        for prefetch, passed in zip(round_.timing, agreed[at:], strict=True):
            prefetch.timed_out = prefetch.timed_out or bool(passed)
        for job, pages in back:  # after the loop above: advancing one submits a load
            self.prefetch_jobs.remove(job)
            self._advance(job, pages, prefetches)

    def apply_all(self, backups: StoreBackups, prefetches: Prefetches) -> None:
        """Every held job with this rank's values (at ``stop``: the workers stopped, every
        job is back)."""
        while self.puts:
            put = self.puts.popleft()
            assert put.done and put.result is not None
            backups.finish(put)
        jobs, self.prefetch_jobs = self.prefetch_jobs, []  # a load submitted now is refused
        for job in jobs:
            assert job.done
            self._advance(job, job.found if job.held_stage is PrefetchPhase.QUERY
                          else job.arrived, prefetches)

    @staticmethod
    def _advance(job: PrefetchJob, pages: int, prefetches: Prefetches) -> None:
        """``job`` is back on every rank with ``pages`` found (a query) or read (a load)."""
        if job.held_stage is PrefetchPhase.QUERY:
            if pages < job.found:  # another rank's store has fewer: the group has fewer
                job.found, job.missing = pages, PageStatus.MISS
                if not pages and job.phase is PrefetchPhase.ANSWERED:
                    job.phase = PrefetchPhase.DONE
        else:
            job.agreed_arrived = pages
        job.held_stage = None
        prefetches.advance(job)
