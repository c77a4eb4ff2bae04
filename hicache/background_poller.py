"""The service's background thread, and the acks it collects for the scheduler.

The thread polls finished ops (event ``query()`` only, under the service lock) and queues
their acks; the scheduler thread collects them (:meth:`BackgroundPoller.collect`: queued
acks first, then what the controller finished since) and applies them to the tree
(:meth:`BackgroundPoller.apply`). Backups that ``insert`` queued with no ``step()`` after
them (a quiet scheduler) it issues before it polls, the only change it makes to the tree
(none for a tensor-parallel rank: :mod:`hicache.rank_agreement`). When nothing happened
for an interval (no ack, no scheduler call, no check) the thread runs the sliced integrity
check (:mod:`hicache.integrity_slices`). With nothing in flight it sleeps until that check
may be due; a queued transfer wakes it (a controller observer). It polls only where the
scheduler did not: a pass that finds the scheduler polled since the last one (with
transfers in flight) or made calls (with none) does nothing and sleeps twice as long as the
one before, so a busy scheduler's thread seldom wakes (each wake takes the GIL).

An exception in the thread is never swallowed: it is recorded in the
:class:`~hicache.call_gate.CallGate`, which raises it on the scheduler thread, counted in
``ServiceStats.background_errors`` and logged; the thread then ends.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import torch

from hicache.controller import Ack
from hicache.metrics import MetricsExporter

from .call_gate import CallGate
from .integrity_slices import SlicedIntegrityCheck
from .interrupts import interrupts_held
from .radix import HiRadixCache

if TYPE_CHECKING:
    from .rank_agreement import RankAgreement
    from .service_stats import ServiceStats

logger = logging.getLogger(__name__)

BUSY_WAKE_S = 1.0
"""Longest sleep of the thread while its scheduler is busy: polling the transfers in flight
itself, or making calls with nothing in flight (a longer check interval is not shortened).
Every pass finding it so doubles the sleep up to this (from the poll interval, about ten
passes; from a 10 ms check interval, seven)."""


QUIET_EVICT_S = 1.0
"""How long the scheduler must have made no call before the thread evicts host leaves to
issue backups it left queued; until then only those that fit go, and the rest wait for a
step (which evicts). An engine locks what it matched in its next call, not a second later."""


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
        # a deque: append and popleft are single C calls, safe between the two threads and
        # holding no Python-level lock a Ctrl-C could leave held (queue.Queue's can be)
        self._acks: collections.deque[Ack] = collections.deque()
        self._thread: threading.Thread | None = None
        # Bells the scheduler thread rings and this thread sleeps on: SimpleQueues, whose
        # put and get run in C, where a threading.Event's set() runs Python code under a
        # lock that a Ctrl-C landing there could leave held (and stop() would wait on).
        self._stop_requested = False
        self._stop_bell: queue.SimpleQueue[None] = queue.SimpleQueue()  # rung by stop()
        # rung when a transfer is queued (or at stop): ends an idle sleep
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._collects = 0  # scheduler polls (collect calls), written by the scheduler only
        self._wake_wanted = True  # the thread sleeps until a check is due: wake it to poll
        self.agreement: RankAgreement | None = None  # set by the service of a TP rank

    @property
    def is_running(self) -> bool:
        """True from :meth:`start` until :meth:`stop` joined the thread."""
        return self._thread is not None

    def start(self) -> None:
        """Start the thread (the caller makes sure it is not running). A Ctrl-C is held
        until it runs and is recorded (:mod:`hicache.interrupts`): recorded iff it runs, so
        :meth:`stop` joins exactly the thread that runs."""
        thread = threading.Thread(target=self._run, name="hicache-service", daemon=True)
        with interrupts_held():
            self._controller.add_observer(self._on_queued)
            self._tree.on_backup_queued = self._on_queued
            thread.start()
            self._thread = thread

    def stop(self) -> None:
        """Tell the thread to end and join it; it is not started again. One cut short by a
        Ctrl-C goes on where it was when called again."""
        self._stop_requested = True
        self._stop_bell.put(None)
        self._wake.put(None)
        if (thread := self._thread) is not None:  # read once: another stop may clear it
            thread.join()
            self._thread = None
        with contextlib.suppress(ValueError):  # not added (start interrupted), or removed
            self._controller.remove_observer(self._on_queued)
        self._tree.on_backup_queued = None

    def _on_queued(self, *_: object) -> None:
        """A transfer or a tree backup was queued: a thread in an idle sleep polls again (on
        the scheduler thread). One that sleeps with transfers in flight passes within
        :data:`BUSY_WAKE_S` anyway, and a wake per queued transfer would undo its backoff."""
        if self._wake_wanted and self._wake.empty():
            self._wake.put(None)

    def drain(self) -> list[Ack]:
        """Every ack the thread queued so far, oldest first."""
        acks, queued = [], self._acks
        while queued:
            acks.append(queued.popleft())
        return acks

    def collect(self) -> list[Ack]:
        """Queued acks first (older), then whatever the controller finished since; on the
        scheduler thread, with the service lock held. With an :attr:`agreement` they are
        held (none returned): a step takes those the ranks agree on."""
        self._collects += 1  # the thread's next pass need not poll
        acks = self.drain() + self._controller.poll_acks()
        if self._exporter is not None:
            self._exporter.refresh()
        if self.agreement is not None:
            self.agreement.hold(acks)
            acks = []
        return acks

    def apply(self, acks: list[Ack]) -> None:
        """Apply ``acks`` to the tree and count them (scheduler thread, service lock held)."""
        self._tree.apply_acks(acks)
        self._stats.acks_applied += len(acks)

    def _run(self) -> None:
        last_ack = last_check = time.monotonic()
        backoff = 1  # the sleep's multiple, doubled by each pass that found the scheduler busy
        calls_seen, collects_seen = self._gate.num_calls, self._collects
        try:
            while True:
                _silence(self._wake)  # before the in-flight count is read: no wake is lost
                self._wake_wanted = True  # the same
                if self._stop_requested:  # read after the silence: stop's wake is not lost
                    break
                now = time.monotonic()
                self._stats.background_passes += 1
                # Read without the lock: a stale count only moves one pass, and a transfer
                # queued after the read wakes the thread.
                in_flight = self._controller.num_in_flight + len(self._tree.queued_backups)
                if in_flight:  # a sleep of at most BUSY_WAKE_S: no wake needed
                    self._wake_wanted = False
                calls, collects = self._gate.num_calls, self._collects
                # A busy scheduler: with transfers in flight, it polled since the last pass
                # (its step() acknowledges them; a poll here would be the same work again);
                # with none, it made calls (so no idle check is due).
                busy = collects != collects_seen if in_flight else calls != calls_seen
                calls_seen, collects_seen = calls, collects
                if in_flight and not busy and self._poll_once():
                    last_ack = now
                # Idle: no ack and no scheduler call for an interval. A check, once
                # started, goes on in short slices and gives up at a scheduler call.
                elif (self._check.in_progress or min(
                        now - last_ack, now - self._gate.last_call_s, now - last_check,
                ) >= self._check_interval_s) and self._step_check():
                    last_check = now
                backoff = min(2 * backoff, 1 << 20) if busy else 1
                sleep_s = self._sleep_s(now, max(last_ack, last_check), backoff, in_flight)
                if _rang(self._wake, sleep_s):
                    # Woken by a transfer being queued: it cannot have finished yet. Poll
                    # one interval later, not now, so that the thread does not take the
                    # GIL and the lock while the scheduler is still issuing the transfer
                    # and launching the forward that reads it (measured on the H100: the
                    # scheduler thread is the host hit's critical path). A busy scheduler
                    # queues transfers all the time: then as many intervals as the backoff.
                    _rang(self._stop_bell, self._busy_sleep_s(self._poll_interval_s, backoff))
        except BaseException as exc:  # recorded and raised on the scheduler thread
            self._gate.fail(exc)
            self._stats.background_errors += 1
            logger.exception("hicache background thread failed")

    def _sleep_s(self, now: float, last_event: float, backoff: int, in_flight: int) -> float:
        """How long to sleep: short slices while a check is in progress; the poll interval
        while transfers were in flight at the pass (``in_flight``); otherwise until the
        idle check may be due (a queued transfer wakes the thread earlier).

        Each wake takes the GIL, and one that comes while the scheduler thread is busy
        slows its calls for up to a millisecond or two (``docs/performance-log.md``). So a pass that
        found the scheduler busy doubles the next sleep (``backoff`` times the base: the
        poll interval while it polls, the check interval while it makes calls with nothing
        in flight), up to :data:`BUSY_WAKE_S`. A pass that found it quiet starts again
        from one interval."""
        if self._check.in_progress:
            return min(self._poll_interval_s, 0.0002)
        if in_flight:
            return self._busy_sleep_s(self._poll_interval_s, backoff)
        idle_since = max(last_event, self._gate.last_call_s)
        due_s = max(self._poll_interval_s, self._check_interval_s - (now - idle_since))
        if backoff == 1:
            return due_s
        return max(due_s, self._busy_sleep_s(self._check_interval_s, backoff))

    @staticmethod
    def _busy_sleep_s(base_s: float, backoff: int) -> float:
        """``backoff`` times ``base_s``, but no more than :data:`BUSY_WAKE_S` (or the base,
        if that is longer)."""
        return min(base_s * backoff, max(base_s, BUSY_WAKE_S))

    def _poll_once(self) -> bool:
        with self._gate.lock:
            if self.agreement is None and (
                    self._tree.has_queued_backups or self._controller.has_queued_writes):
                self._issue_writes()  # backups queued with no step after them
            acks = self._controller.poll_acks()  # bounds errors go to step(), not this thread
            for ack in acks:  # under the lock: a call between would find them nowhere
                self._acks.append(ack)
            self._stats.polls += 1
            if self._exporter is not None:
                self._exporter.refresh()
        return bool(acks)

    def _issue_writes(self) -> None:
        """Issue the tree's queued backups that fit the host as it is (allocating their host
        slots: the one change this thread makes to the tree, under the service lock, so a
        sliced check in progress starts over) and the controller's queued writes, on the
        controller's device (this thread's current device is its own). Each write waits on
        the stream that was current where it was queued. It evicts host leaves to make room
        only once the scheduler made no call for :data:`QUIET_EVICT_S`: a node an engine
        just matched stays in the tree until its lock, as with no thread."""
        tree = self._tree
        queued = len(tree.queued_backups)
        evict = time.monotonic() - self._gate.last_call_s >= QUIET_EVICT_S
        device = self._controller.device
        if device.type != "cuda":
            tree.issue_queued_backups(evict=evict)
        else:
            with torch.cuda.device(device):
                tree.issue_queued_backups(evict=evict)
        if queued and len(tree.queued_backups) != queued and self._check.in_progress:
            self._check.abandon()  # the tree changed: the check starts over
            self._stats.integrity_checks_abandoned += 1

    def _step_check(self) -> bool:
        """One slice of the background integrity check; True when it completed a check."""
        check = self._check
        given_up = check.stats.abandoned + check.stats.unconfirmed  # a call's race: given up
        done = check.step()
        self._stats.integrity_checks_abandoned += (
            check.stats.abandoned + check.stats.unconfirmed - given_up)
        if done:
            self._stats.integrity_checks += 1
        return done


def _rang(bell: queue.SimpleQueue[None], timeout_s: float) -> bool:
    """Sleep until ``bell`` rings (True) or ``timeout_s`` passed (False)."""
    try:
        bell.get(timeout=timeout_s)
    except queue.Empty:
        return False
    return True


def _silence(bell: queue.SimpleQueue[None]) -> None:
    """Forget the rings so far (this thread is the bell's only reader)."""
    while not bell.empty():
        bell.get_nowait()
