"""The way every scheduler call enters :class:`~hicache.service.HiCacheService`.

A call first raises the background thread's recorded failure (as
:class:`~hicache.service.ServiceError`, with the original as ``__cause__``); then it counts
itself and notes its time *before* it waits for the service lock, so that a background
integrity check between two of its slices sees the call and gives up, and the idle timer of
the background thread restarts; then it refuses to run once ``stop`` has begun; then it
holds the lock for the rest of the call.

``stop`` sets ``stopped`` when it begins, before it waits for the lock, so that a call made
while a ``stop`` on another thread drains is refused rather than run on a stopped service
once the lock is free; ``closed`` says that ``stop`` finished (a second ``stop`` returns).
A call that passed the check just before ``stop`` began runs if it takes the lock first;
if ``stop`` took it first, the call finds ``closed`` once it has the lock
(:meth:`CallGate.check_open`) and is refused.

The failure is recorded by the background thread and read by the scheduler thread; the
call counters are written by the scheduler thread only.
"""

from __future__ import annotations

import threading
import time


class CallGate:
    """The service lock, the count and time of scheduler calls, the stopped and closed flags
    and the background failure that calls surface.

    Args:
        lock: the service lock (``HiCacheService.service_lock``).
        error_type: what a call raises once the background thread failed (the service's
            ``ServiceError``), with the failure as ``__cause__``.
    """

    def __init__(self, lock: threading.Lock, error_type: type[Exception]) -> None:
        self.lock = lock
        self.stopped = False  # stop() began: calls are refused
        self.lifecycle = threading.Lock()  # start() and stop() take turns (lifecycle.py)
        self.closed = False  # stop() finished
        self.last_call_s = 0.0  # monotonic time of the latest scheduler call
        self.num_calls = 0  # scheduler calls started (the background check compares it)
        self._error_type = error_type
        self._error: BaseException | None = None
        self._error_raised = False

    def call(self) -> threading.Lock:
        """Admit one scheduler call: the service lock, for the call to hold as a ``with``
        statement's context manager for its body.

        The lock itself, not a generator context manager around it: a Ctrl-C that lands in
        a Python ``__exit__`` before it resumed the generator would leave the generator, and
        so the lock, held while the interrupt's traceback lives, and ``stop()`` (which runs
        while it propagates) would wait for the lock forever. The lock's own ``__enter__``
        and ``__exit__`` run in C.

        Raises:
            ServiceError: the background thread failed (see :meth:`raise_if_failed`).
            RuntimeError: the service was stopped.
        """
        if self._error is not None:  # read here: six calls a request, no failure
            self.raise_if_failed()
        self.last_call_s = time.monotonic()
        self.num_calls += 1  # before the lock: a background check between slices sees it
        if self.stopped:
            raise RuntimeError("the service was stopped")
        return self.lock

    def check_open(self) -> None:
        """The first statement of every call's ``with`` body: ``RuntimeError`` when ``stop``
        finished while the call waited for the lock (it passed :meth:`call`'s check just
        before ``stop`` began, and ``stop`` took the lock first)."""
        if self.closed:
            raise RuntimeError("the service was stopped")

    def fail(self, exc: BaseException) -> None:
        """Record the background thread's exception; every later call raises it."""
        self._error = exc

    def raise_if_failed(self) -> None:
        """Raise ``error_type`` from the recorded exception, if there is one."""
        if self._error is not None:
            self._error_raised = True
            raise self._error_type(
                f"hicache background thread failed: {self._error!r}; stop the service"
            ) from self._error

    def failure(self) -> Exception | None:
        """The ``ServiceError`` a call would raise now that the background thread failed
        (counted as raised), else ``None``: for a tensor-parallel rank's step, which must
        still make its collective to tell the other ranks."""
        try:
            self.raise_if_failed()
        except self._error_type as error:
            return error
        return None

    def check_lock_free(self, op: str) -> None:
        """What :meth:`call` refuses, for a call that takes no lock (``wait_until``): a
        failed background thread, then a stopped service (``RuntimeError`` naming ``op``)."""
        self.raise_if_failed()
        if self.stopped:
            raise RuntimeError(f"{op}: the service was stopped")

    @property
    def unsurfaced(self) -> BaseException | None:
        """The recorded failure if no call has raised it yet, else ``None``."""
        return None if self._error_raised else self._error

    def surfaced(self) -> None:
        """Note that the recorded failure reached the engine another way (``stop`` need not
        raise it)."""
        self._error_raised = True

    def raise_if_unsurfaced(self) -> None:
        """Raise the recorded failure if no call has raised it yet (for ``stop``)."""
        if self.unsurfaced is not None:
            self.raise_if_failed()
