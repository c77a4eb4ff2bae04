"""What a storage worker does: a put of host pages, or a prefetch's query and load.

A job is made on the scheduler thread, run on a worker thread, and handed back to the
scheduler thread, which alone reads its results into the tree. While it runs, the worker
reads or writes only the host slots the job names; the scheduler never frees them before
the job is back (``done``). The fields a worker writes are plain values assigned once per
step, and the scheduler reads them only after the job's ``changed`` event, or, for the
prefetch's ``arrived`` count, knowing that the pages it counts are no longer written.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

import torch

from hicache.radix.key import TOKEN_BYTES
from hicache.radix.node import PendingStore
from hicache.storage import PageStatus, StorageBackend, StorageResult

from .hashes import key_page_hashes, split_hashes
from .page_buffers import GetBuffers, HostPools, put_buffers


@dataclass(eq=False)
class PutJob:
    """Store the pages at ``host`` (whole pages, aligned with ``hashes``)."""

    pending: PendingStore
    hashes: list[bytes]
    host: torch.Tensor  # int64 HOST_FULL slots, a copy owned by the job
    swa: torch.Tensor | None = None  # aligned HOST_SWA slots (hybrid models), a copy
    result: StorageResult | None = None
    done: bool = False

    def run(self, store: StorageBackend, pools: HostPools) -> None:
        self.result = store.put(self.hashes, put_buffers(pools, self.host, self.swa))

    def fail(self, message: str) -> None:
        self.result = StorageResult((PageStatus.ERROR,) * len(self.hashes), message)


class PrefetchPhase(enum.Enum):
    QUERY = "query"  # the worker asks the store which pages it has
    ANSWERED = "answered"  # the scheduler allocates host slots for the pages found
    LOAD = "load"  # the worker reads the pages into those slots
    DONE = "done"  # nothing more will be written; the scheduler finishes it


@dataclass(eq=False)
class PrefetchJob:
    """One request's prefetch: the whole pages of ``tail`` (tree key bytes after its cached
    prefix), the first after the page whose hash is ``parent``.

    The worker computes the pages' hashes before its query (a 32k-token tail's take about
    a millisecond, off the scheduler thread): ``hashes`` and ``joined`` are set once, joined
    last, and read by the scheduler only once the query is back."""

    tail: bytes
    parent: bytes
    page_size: int
    batch_pages: int
    hashes: list[bytes] = field(default_factory=list)  # one per page (set by the query)
    joined: bytes | None = None  # the same, joined (set by the query, after ``hashes``)
    phase: PrefetchPhase = PrefetchPhase.QUERY
    found: int = 0  # leading pages the store has (set by the query)
    # why the query's run of pages ended: a miss, or the store's timeout or error (a dead
    # store is not an empty one); the pages after ``found`` count as this
    missing: PageStatus = PageStatus.MISS
    host: torch.Tensor | None = None  # slots of the ``found`` pages (set by the scheduler)
    swa: torch.Tensor | None = None  # their SWA slots (hybrid models; set with ``host``)
    arrived: int = 0  # leading pages loaded and verified, in ``host``
    statuses: list[PageStatus] = field(default_factory=list)  # per page loaded so far
    error: str | None = None  # the store's first error message, for a log line
    unread: str | None = None  # why found pages were never read: host_full, queue_full,
    # cancelled (the service stopped), error (the job raised)
    cancelled: bool = False  # set by the scheduler: stop after the current batch
    done: bool = False  # back from the worker (reset when submitted again)
    # a tensor-parallel rank's (hicache.l3.held_jobs): the phase it was submitted in until
    # the ranks agree it is back, and the pages every rank has read (None: no agreement)
    held_stage: PrefetchPhase | None = None
    agreed_arrived: int | None = None
    changed: threading.Event = field(default_factory=threading.Event)

    @property
    def num_pages(self) -> int:
        return len(self.tail) // (TOKEN_BYTES * self.page_size)

    def run(self, store: StorageBackend, pools: HostPools) -> None:
        if self.phase is PrefetchPhase.QUERY:
            if self.joined is None:
                joined = key_page_hashes(self.tail, self.page_size, self.parent)
                self.hashes = split_hashes(joined)
                self.joined = joined
            result = store.exists(self.hashes)
            self.error = result.error
            self.found = result.num_leading_ok
            if self.found < len(self.hashes):
                self.missing = result.statuses[self.found]
            self.phase = PrefetchPhase.ANSWERED if self.found else PrefetchPhase.DONE
            return
        assert self.phase is PrefetchPhase.LOAD and self.host is not None
        buffers = GetBuffers(pools, self.host, self.swa)
        for start in range(0, self.found, self.batch_pages):
            if self.cancelled:
                break
            end = min(self.found, start + self.batch_pages)
            result = store.get(self.hashes[start:end], buffers.pages[start:end])
            self.statuses.extend(result.statuses)
            self.error = self.error or result.error
            ok = result.num_leading_ok
            buffers.scatter(start, start + ok)
            self.arrived = start + ok  # these pages are final: later batches write others
            if ok < end - start:
                break
        self.phase = PrefetchPhase.DONE

    def fail(self, message: str) -> None:
        self.error = message
        if self.phase is PrefetchPhase.QUERY:
            self.missing = PageStatus.ERROR
        else:
            self.unread = self.unread or "error"
        self.phase = PrefetchPhase.DONE
