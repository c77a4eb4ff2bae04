"""A storage worker: one thread that runs jobs against the shared store, from a bounded queue.
The thread starts with the first job, not with the worker.

The scheduler thread submits jobs (:meth:`StorageWorker.submit` never blocks: a full queue
refuses the job, and the caller counts it) and collects finished ones with :meth:`finished`.
A job that raises is ended as failed, logged and counted; the thread goes on. The store
bounds every call by its deadline, so a dead or slow store delays a job by that much at most
and never hangs the thread.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Protocol

from hicache.storage import StorageBackend

from .page_buffers import HostPools

logger = logging.getLogger(__name__)


class Job(Protocol):
    done: bool

    def run(self, store: StorageBackend, pools: HostPools) -> None: ...

    def fail(self, message: str) -> None: ...


class StorageWorker:
    """A daemon thread running :class:`Job` s in order, started by the first (see the module
    docstring).

    Args:
        name: the thread's name (``hicache-l3-prefetch``, ``hicache-l3-backup``).
        store: the shared store; every call is bounded by its deadline.
        pools: the host pools whose slots the jobs read and write.
        max_queued: jobs waiting at most; more are refused.
    """

    def __init__(self, name: str, store: StorageBackend, pools: HostPools,
                 max_queued: int) -> None:
        self.store = store
        self.pools = pools
        self.errors = 0
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queued)
        self._finished: collections.deque[Job] = collections.deque()
        self._wake = threading.Event()  # set whenever a job finishes
        self._closed = False
        # started by the first job: a tier built and dropped unused leaves no thread behind
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def depth(self) -> int:
        """Jobs waiting (not the one running)."""
        return self._queue.qsize()

    @property
    def closed(self) -> bool:
        """:meth:`close` was called: every job submitted from now on is refused."""
        return self._closed

    def submit(self, job: Job) -> bool:
        """Queue ``job``; ``False`` (nothing queued) when the queue is full or closed."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            return False
        if self._thread.ident is None:
            self._thread.start()
        return True

    def finished(self) -> list[Job]:
        """Jobs finished since the last call, in the order they finished."""
        jobs = []
        while self._finished:
            jobs.append(self._finished.popleft())
        return jobs

    def wait_finished(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a job to finish; ``True`` if one did (or had)."""
        woke = self._wake.wait(timeout_s)
        self._wake.clear()
        return woke or bool(self._finished)

    def close(self) -> None:
        """Run what is queued, then stop the thread and wait for it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.ident is None:  # never started
            if self._queue.empty():
                return
            self._thread.start()  # a job queued as a Ctrl-C landed before its start: run it
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job.run(self.store, self.pools)
            except Exception as exc:  # a job never takes the thread down
                self.errors += 1
                logger.exception("storage worker %s: job failed", self._thread.name)
                job.fail(f"{type(exc).__name__}: {exc}")
            job.done = True
            self._finished.append(job)
            changed = getattr(job, "changed", None)
            if changed is not None:
                changed.set()
            self._wake.set()
