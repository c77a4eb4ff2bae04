"""The shared store's (L3) families: a plain snapshot of the tier and its store, then one
family per ``hicache_l3_*`` metric of :data:`~.names.METRICS`.

Every family has the same samples with or without a store (every outcome, status, op and
queue of :mod:`~.names`, at zero), so a dashboard or an alert over one works on a service
that has no store, and a series never appears out of nothing; ``hicache_l3_enabled`` tells
an idle store from no store. The latency histograms come from the store's own bucket counts
(``StorageStats.latency_counts``), which are cumulative, so nothing is drained.
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client.metrics_core import Metric

from hicache.l3.stats import BACKUP_OUTCOMES, PREFETCH_OUTCOMES
from hicache.storage.base import LATENCY_BUCKETS_S, TIMED_OPS, StorageStats

from . import names as n
from .families import add, add_histogram, by_label
from .histogram import histogram_state
from .sources import StorageTierSource

_TIER_SCALARS = ("prefetches", "queried_tokens", "found_tokens", "backup_evictions",
                 "worker_errors")
# Each page status and byte kind of the families, with the StorageStats field it reads.
_PAGE_FIELDS = {"found": "pages_found", "hit": "pages_hit", "missed": "pages_missed",
                "corrupt": "pages_corrupt", "timeout": "pages_timeout", "error": "pages_error",
                "written": "pages_written", "skipped": "pages_skipped",
                "deleted": "pages_deleted", "evicted": "pages_evicted"}
_BYTE_FIELDS = {"read": "bytes_read", "written": "bytes_written", "evicted": "bytes_evicted"}
assert tuple(_PAGE_FIELDS) == n.L3_PAGE_STATUSES and tuple(_BYTE_FIELDS) == n.L3_BYTE_KINDS


class L3Snapshot(NamedTuple):
    """Plain copies of the tier's counters, its queue depths and the store's stats."""

    enabled: bool
    tier: dict[str, int]
    prefetch_tokens: dict[str, int]
    backup_pages: dict[str, int]
    queue_depths: dict[str, int]
    store: StorageStats
    write_share_ranks: int = 0


def snapshot(tier: StorageTierSource | None) -> L3Snapshot:
    """Copy what the families need of ``tier`` (zeros for ``None``). Call it under the lock
    the tier's counters are written under (the service lock)."""
    if tier is None:
        return L3Snapshot(False, dict.fromkeys(_TIER_SCALARS, 0), {}, {}, {}, StorageStats())
    stats = tier.stats
    return L3Snapshot(
        True, {name: int(getattr(stats, name)) for name in _TIER_SCALARS},
        dict(stats.prefetch_tokens), dict(stats.backup_pages), dict(tier.queue_depths),
        tier.store.stats(), int(tier.write_share_ranks),
    )


def add_families(families: dict[str, Metric], snap: L3Snapshot) -> None:
    """Fill the ``hicache_l3_*`` families of ``families`` (keyed by name) from ``snap``."""
    tier, store = snap.tier, snap.store
    add(families[n.L3_ENABLED], {(): int(snap.enabled)})
    add(families[n.L3_PREFETCHES], {(): tier["prefetches"]})
    add(families[n.L3_QUERIED_TOKENS], {(): tier["queried_tokens"]})
    add(families[n.L3_FOUND_TOKENS], {(): tier["found_tokens"]})
    add(families[n.L3_PREFETCH_TOKENS], by_label(snap.prefetch_tokens, PREFETCH_OUTCOMES))
    add(families[n.L3_BACKUP_PAGES], by_label(snap.backup_pages, BACKUP_OUTCOMES))
    add(families[n.L3_WRITTEN_BACK_NODES], {(): tier["backup_evictions"]})
    add(families[n.L3_WORKER_ERRORS], {(): tier["worker_errors"]})
    add(families[n.L3_WRITE_SHARE_RANKS], {(): snap.write_share_ranks})
    add(families[n.L3_QUEUED_JOBS], by_label(snap.queue_depths, n.L3_QUEUES))
    add(families[n.L3_STORE_PAGES],
        {(status,): getattr(store, name) for status, name in _PAGE_FIELDS.items()})
    add(families[n.L3_STORE_BYTES],
        {(kind,): getattr(store, name) for kind, name in _BYTE_FIELDS.items()})
    add(families[n.L3_STORE_OPS], {(op,): getattr(store, f"{op}_calls") for op in n.L3_OPS})
    add(families[n.L3_OPEN_CIRCUITS], {(): store.open_circuits})
    add(families[n.L3_CIRCUIT_OPENS], {(): store.circuit_opens})
    empty = (0,) * (len(LATENCY_BUCKETS_S) + 1)
    for op in TIMED_OPS:
        counts = store.latency_counts.get(op, empty)
        state = histogram_state(LATENCY_BUCKETS_S, counts, getattr(store, f"{op}_seconds"))
        add_histogram(families[n.L3_STORE_DURATION], (op,), state)
