"""The service's background thread, and the acks it collects for the scheduler.

The thread polls finished ops (event ``query()`` only, under the service lock) and puts
their acks on a queue; it never touches the tree. The scheduler thread collects them with
:meth:`BackgroundPoller.collect` (queued acks first, then whatever the controller finished
since) and applies them to the tree with :meth:`BackgroundPoller.apply`. When nothing
happened for an interval (no ack, no scheduler call, no check) the thread runs the sliced
integrity check (:mod:`hicache.integrity_slices`). With nothing in flight it sleeps until
that check may be due; a queued transfer wakes it (a controller observer).

An exception in the thread is never swallowed: it is recorded in the
:class:`~hicache.call_gate.CallGate`, which raises it on the scheduler thread, counted in
``ServiceStats.background_errors`` and logged; the thread then ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from hicache.controller import Ack
from hicache.metrics import MetricsExporter

from .call_gate import CallGate
from .integrity_slices import SlicedIntegrityCheck
from .radix import HiRadixCache

if TYPE_CHECKING:
    from .service_stats import ServiceStats

logger = logging.getLogger(__name__)


class BackgroundPoller:
    """The background thread of one service, and the queue of acks it polled.

    Args:
        gate: the service's call gate (its lock, the time of the latest scheduler call,
            where a failure is recorded).
        tree: the tree that acks are applied to; its controller's finished ops are polled.
        stats: the service's counters.
        exporter: metrics refreshed after every poll, or ``None``.
        check: the sliced integrity check run when idle.
        check_interval_s: idle seconds (no ack, no scheduler call, no check) before a check.
        poll_interval_s: sleep between polls.
    """

    def __init__(
        self,
        *,
        gate: CallGate,
        tree: HiRadixCache,
        stats: ServiceStats,
        exporter: MetricsExporter | None,
        check: SlicedIntegrityCheck,
        check_interval_s: float,
        poll_interval_s: float,
    ) -> None:
        self._gate = gate
        self._tree = tree
        self._controller = tree.controller
        self._stats = stats
        self._exporter = exporter
        self._check = check
        self._check_interval_s = check_interval_s
        self._poll_interval_s = poll_interval_s
        self._acks: queue.Queue[Ack] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # set when a transfer is queued (or at stop): ends an idle sleep
        self._wake = threading.Event()

    @property
    def is_running(self) -> bool:
        """True from :meth:`start` until :meth:`stop` joined the thread."""
        return self._thread is not None

    def start(self) -> None:
        """Start the thread (the caller makes sure it is not running)."""
        self._controller.add_observer(self._on_queued)
        self._thread = threading.Thread(target=self._run, name="hicache-service", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Tell the thread to end and join it; it is not started again."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._controller.remove_observer(self._on_queued)

    def _on_queued(self, *_: object) -> None:
        """A transfer was queued: an idle thread polls again (on the scheduler thread)."""
        if not self._wake.is_set():
            self._wake.set()

    def drain(self) -> list[Ack]:
        """Every ack the thread queued so far, oldest first."""
        acks = []
        while True:
            try:
                acks.append(self._acks.get_nowait())
            except queue.Empty:
                return acks

    def collect(self) -> list[Ack]:
        """Queued acks first (older), then whatever the controller finished since; on the
        scheduler thread, with the service lock held."""
        acks = self.drain() + self._controller.poll_acks()
        if self._exporter is not None:
            self._exporter.refresh()
        return acks

    def apply(self, acks: list[Ack]) -> None:
        """Apply ``acks`` to the tree and count them; on the scheduler thread, with the
        service lock held."""
        self._tree.apply_acks(acks)
        self._stats.acks_applied += len(acks)

    def _run(self) -> None:
        last_ack = last_check = time.monotonic()
        try:
            while True:
                self._wake.clear()  # before the in-flight count is read: no wake is lost
                if self._stopping.is_set():  # read after the clear: stop's wake is not lost
                    break
                now = time.monotonic()
                if self._poll_once():
                    last_ack = now
                # Idle: no ack and no scheduler call for an interval. A check, once
                # started, goes on in short slices and gives up at a scheduler call.
                elif (self._check.in_progress or min(
                        now - last_ack, now - self._gate.last_call_s, now - last_check,
                ) >= self._check_interval_s) and self._step_check():
                    last_check = now
                if self._wake.wait(self._sleep_s(now, max(last_ack, last_check))):
                    # Woken by a transfer being queued: it cannot have finished yet. Poll
                    # one interval later, not now, so that the thread does not take the
                    # GIL and the lock while the scheduler is still issuing the transfer
                    # and launching the forward that reads it (measured on the H100: the
                    # scheduler thread is the host hit's critical path).
                    self._stopping.wait(self._poll_interval_s)
        except BaseException as exc:  # recorded and raised on the scheduler thread
            self._gate.fail(exc)
            self._stats.background_errors += 1
            logger.exception("hicache background thread failed")

    def _sleep_s(self, now: float, last_event: float) -> float:
        """How long to sleep: short slices while a check is in progress; the poll interval
        while transfers are in flight; otherwise until the idle check may be due (a
        queued transfer wakes the thread earlier). An idle thread that woke every
        millisecond would take the GIL from a scheduler thread a thousand times a second
        for nothing."""
        if self._check.in_progress:
            return min(self._poll_interval_s, 0.0002)
        if self._controller.num_in_flight:  # read without the lock: a stale count only
            return self._poll_interval_s     # moves one poll
        idle_since = max(last_event, self._gate.last_call_s)
        return max(self._poll_interval_s, self._check_interval_s - (now - idle_since))

    def _poll_once(self) -> bool:
        with self._gate.lock:
            acks = self._controller.poll_acks()  # bounds errors go to step(), not this thread
            self._stats.polls += 1
            if self._exporter is not None:
                self._exporter.refresh()
        for ack in acks:
            self._acks.put(ack)
        return bool(acks)

    def _step_check(self) -> bool:
        """One slice of the background integrity check; True when it completed a check."""
        check = self._check
        abandoned = check.stats.abandoned
        done = check.step()
        self._stats.integrity_checks_abandoned += check.stats.abandoned - abandoned
        if done:
            self._stats.integrity_checks += 1
        return done
