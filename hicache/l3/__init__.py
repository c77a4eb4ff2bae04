"""The shared store (L3) on the cache's side: prefetches into host slots and backups out
of them, on two worker threads, under the ``storage`` section's policies.

- :mod:`~hicache.l3.tier`: :class:`StorageTier`, what the service drives;
- :mod:`~hicache.l3.prefetches`: a match's uncached tail fetched from the store
  (:class:`Prefetch`);
- :mod:`~hicache.l3.backups`: host pages copied to the store under the write policy;
- :mod:`~hicache.l3.jobs`, :mod:`~hicache.l3.worker`: what the worker threads run;
- :mod:`~hicache.l3.held_jobs`, :mod:`~hicache.l3.shared_copy`: a tensor-parallel rank's
  jobs held until the ranks agree, and its share of the writes to a copy they share;
- :mod:`~hicache.l3.hashes`: the chained page hashes of tree nodes;
- :mod:`~hicache.l3.stats`: the tier's counters.

The store itself (file, Redis) is :mod:`hicache.storage`.
"""

from __future__ import annotations

from .prefetches import Prefetch
from .stats import BACKUP_OUTCOMES, PREFETCH_OUTCOMES, StorageTierStats
from .tier import StorageTier

__all__ = ["BACKUP_OUTCOMES", "PREFETCH_OUTCOMES", "Prefetch", "StorageTier", "StorageTierStats"]
