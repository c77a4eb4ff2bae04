"""A circuit breaker per server: after a failure, calls to that server fail at once (misses)
until a backoff has passed; then one call may try again. Each failure in a row doubles the
backoff up to a cap; a success closes the circuit and resets it. A dead server thus costs one
connection attempt per backoff period, not one per call, and never a wait on every call."""

from __future__ import annotations

import threading
import time


class Circuit:
    """Open/closed state of one server.

    Args:
        base_backoff_s: how long the circuit stays open after the first failure.
        max_backoff_s: cap of the doubling backoff.
    """

    def __init__(self, base_backoff_s: float = 0.1, max_backoff_s: float = 5.0) -> None:
        if not 0 < base_backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < base_backoff_s <= max_backoff_s, got {base_backoff_s}, "
                             f"{max_backoff_s}")
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._backoff_s = base_backoff_s
        self._open_until: float | None = None
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self._open_until is not None

    def allow(self) -> bool:
        """True if a call may talk to the server now: the circuit is closed, or its backoff
        has passed and no other call is already trying (that call is the trial)."""
        with self._lock:
            if self._open_until is None:
                return True
            now = time.monotonic()
            if now < self._open_until:
                return False
            self._open_until = now + self._backoff_s  # the others wait while this call tries
            return True

    def succeeded(self) -> bool:
        """Close the circuit; True if it was open."""
        with self._lock:
            was_open = self._open_until is not None
            self._open_until = None
            self._backoff_s = self.base_backoff_s
            return was_open

    def failed(self) -> bool:
        """Open (or re-open) the circuit for the current backoff, then double it; True if it
        was closed before."""
        with self._lock:
            was_closed = self._open_until is None
            self._open_until = time.monotonic() + self._backoff_s
            self._backoff_s = min(2 * self._backoff_s, self.max_backoff_s)
            return was_closed
