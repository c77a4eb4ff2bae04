"""Counters of the shared-store tier on the cache's side (the store's own are
:class:`hicache.storage.StorageStats`).

Prefetch outcomes count tokens, by how each prefetched page ended:

- ``used``: arrived and given to the tree (a later match finds it on the host);
- ``not_found``: the store did not have it (the query's answer, or a miss on read); a
  query the store failed counts its pages as ``timeout`` or ``error`` instead;
- ``cached``: arrived, but the tree had the page meanwhile (another request computed it);
- ``timeout``: not arrived when the prefetch was finished (its policy's deadline, or
  ``best_effort``), or the store's deadline passed;
- ``corrupt``, ``error``: the store's page failed verification, or the store failed;
- ``after_failure``: found, but after a page the read failed on (a miss, a corrupt page, a
  failed read): the prefix ends at its first gap, and the pages after it are not used
  (one that failed itself counts as it failed);
- ``host_full``: found, but the host had no room for it;
- ``queue_full``: never asked for: the prefetch queue was full;
- ``cancelled``: the service stopped, or the engine dropped the request.

Backups count pages: ``stored`` (the store has them now), ``failed`` (the store answered
otherwise), ``dropped`` (never sent: the backup queue was full), ``no_swa_rows`` (a hybrid
model's page whose SWA rows are not all on the host: not sent, since a page goes to the
store with its SWA rows or not at all).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

PageObserver = Callable[[str, list[bytes], torch.Tensor, torch.Tensor | None], None]
"""Called on the scheduler thread with ``("put", hashes, host_slots, swa_slots)`` when pages
are sent to the store and ``("arrive", hashes, host_slots, swa_slots)`` when prefetched
pages reach the tree (one int64 host slot per token, aligned with the hashes' pages; the
aligned SWA host slots of a hybrid model, else ``None``); for audits and tests."""

PREFETCH_OUTCOMES = ("used", "not_found", "cached", "timeout", "corrupt", "error",
                     "after_failure", "host_full", "queue_full", "cancelled")
BACKUP_OUTCOMES = ("stored", "failed", "dropped", "no_swa_rows")


@dataclass
class StorageTierStats:
    """Plain counters, written on the scheduler thread only (``hicache.metrics`` reads them
    under the service lock). Queue depths are gauges read from the workers."""

    prefetches: int = 0
    """Prefetches started (one per request whose uncached tail reached the threshold)."""
    queried_tokens: int = 0
    """Tokens asked about (whole pages after the tree's match)."""
    found_tokens: int = 0
    """Tokens the store said it had, in a run from the first page asked about."""
    prefetch_tokens: Counter[str] = field(default_factory=Counter)
    """Tokens by prefetch outcome (module docstring)."""
    backup_pages: Counter[str] = field(default_factory=Counter)
    """Pages by backup outcome (module docstring)."""
    backup_evictions: int = 0
    """Host nodes written back to the store before their host copy left (``write_back``)."""
    worker_errors: int = 0
    """Exceptions a storage worker caught (the job ended as ``error``; logged)."""


class FailureLog:
    """Log lines for the store's failures of one kind of call (``what``), which the
    counters above count: a WARNING with the store's message when they start, DEBUG lines
    while they go on (a dead store fails every call), INFO once a call succeeds again."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failing = False

    def note(self, error: str | None) -> None:
        """One call's outcome: the store's first error message, ``None`` if it had none."""
        if error is None:
            if self.failing:
                logger.info("shared store: %s succeed again", self.what)
            self.failing = False
        elif self.failing:
            logger.debug("shared store: %s failed: %s", self.what, error)
        else:
            self.failing = True
            logger.warning("shared store: %s failed: %s (counted; further failures are "
                           "logged at DEBUG until one succeeds)", self.what, error)
