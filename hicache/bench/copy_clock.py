"""The time a CPU service's backend spends copying rows, so that ``hicache bench
scheduler`` can report bookkeeping with the copies excluded.

A CPU pool's "transfer" is a synchronous row copy inside ``start_writing``; on a GPU the
copy runs on a side stream and the scheduler thread only issues it. The issue's figures
that say "copy excluded" (a controller op, an insert with its backup queued) subtract the
copies timed here from the call's time.
"""

from __future__ import annotations

import time
from typing import Any

from hicache.controller import CacheController


class CopyClock:
    """Nanoseconds ``controller``'s backend spent in ``copy`` (the row copies), summed in
    :attr:`ns`: the backend's ``copy`` is wrapped on this backend object only, until
    :meth:`close`."""

    def __init__(self, controller: CacheController) -> None:
        self.ns = 0
        self._backend = controller.backend
        copy = self._backend.copy

        def timed_copy(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter_ns()
            try:
                copy(*args, **kwargs)
            finally:
                self.ns += time.perf_counter_ns() - start

        self._backend.copy = timed_copy  # type: ignore[method-assign]

    def close(self) -> None:
        """Unwrap the backend's ``copy`` (its class's method again)."""
        if "copy" in vars(self._backend):
            del self._backend.copy
