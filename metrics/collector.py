"""A ``prometheus_client`` collector that reads hicache's plain counters on every scrape.

Nothing is copied into Prometheus objects between scrapes: :meth:`HiCacheCollector.collect`
takes a snapshot of the sources and builds one metric family per :data:`~.names.METRICS`
entry, so values are always current and no refresh thread is needed. The one exception is
the duration histogram: the controller keeps only the durations measured since the last
drain, so :meth:`HiCacheCollector.refresh` drains them into a :class:`DurationHistogram`.
The shared store's (L3) families are built by :mod:`~.l3`, from the tier the ``storage``
callable returns at each scrape.

Threads: ``collect`` runs on the HTTP server's thread. Snapshots copy each counter mapping
with one ``dict()`` call, which is atomic in CPython, so a scrape never sees a mapping
change size under it. Draining durations on the scrape thread would race with the thread
that appends them, so ``collect`` drains only when ``source_lock`` (the lock under which
the owner acknowledges ops) was given; otherwise the owner calls ``refresh`` on the thread
that acknowledges ops. Lock order: ``source_lock``, then the collector's own lock, then the
store's stats lock (taken by ``store.stats()``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from hicache import __version__

from . import l3
from . import names as n
from .families import Labelled, add, add_histogram, by_label, family, union
from .histogram import DurationHistogram, HistogramState
from .sources import (
    CacheSource,
    PoolUsage,
    PoolUsageFn,
    ServiceSource,
    StorageTierFn,
    TransferSource,
)


@dataclass
class _Snapshot:
    """Values of every source at one instant (plain copies)."""

    submitted: dict[str, int]
    acknowledged: dict[str, int]
    tokens: dict[tuple[str, str], int]
    bytes: dict[tuple[str, str], int]
    backend_ops: dict[tuple[str, str], int]
    histograms: dict[str, HistogramState]
    pools: list[PoolUsage] = field(default_factory=list)
    cache: dict[str, int] | None = None
    cache_reasons: dict[str, dict[str, int]] = field(default_factory=dict)
    background_errors: int | None = None
    rank_agreements: int | None = None
    rank_held_ops: dict[str, int] = field(default_factory=dict)
    storage: l3.L3Snapshot = field(default_factory=lambda: l3.snapshot(None))


_CACHE_SCALARS = (
    "matched_tokens", "device_hit_tokens", "host_hit_tokens", "inserted_tokens",
    "duplicate_tokens", "evicted_device_tokens", "evicted_host_tokens", "loaded_back_tokens",
    "backed_up_tokens",
)
_CACHE_REASONS = ("dropped_tokens", "refused_load_backs", "refused_backups")


class HiCacheCollector:
    """Exports the sources as the metrics of :data:`~.names.METRICS`.

    Args:
        transfers: the controller's transfer counters.
        cache: the radix tree's counters (``None``: tree metrics have no samples).
        pool_usage: returns one ``(tier, pool, used_tokens, total_tokens)`` row per pool.
        service: the service's counters (``None``: no background error samples).
        storage: returns the shared-store tier, or ``None`` when there is none; the L3
            families are zeros without one (and when ``storage`` is not given).
        source_lock: held while a scrape reads the sources; when given, a scrape also
            drains durations (see the module docstring).
        duration_buckets_s: upper bounds of the duration histogram, in seconds.
    """

    def __init__(
        self,
        transfers: TransferSource,
        *,
        cache: CacheSource | None = None,
        pool_usage: PoolUsageFn | None = None,
        service: ServiceSource | None = None,
        storage: StorageTierFn | None = None,
        source_lock: AbstractContextManager[object] | None = None,
        duration_buckets_s: Sequence[float] = n.DURATION_BUCKETS_S,
    ) -> None:
        self.transfers = transfers
        self.cache = cache
        self.pool_usage = pool_usage
        self.service = service
        self.storage = storage
        self.source_lock = source_lock
        self.histogram = DurationHistogram(duration_buckets_s)
        self._lock = threading.Lock()

    def refresh(self) -> int:
        """Drain the measured durations into the histogram; returns how many were drained.

        Call it on the thread that acknowledges ops (e.g. right after ``poll()``); it does
        not take ``source_lock``, so it may be called while holding it.
        """
        with self._lock:
            return self.histogram.observe_all(self.transfers.drain_durations())

    def describe(self) -> Iterator[Metric]:
        """Families without samples, one per metric (lets the registry check name clashes
        without reading the sources)."""
        for spec in n.METRICS:
            yield family(spec)

    def collect(self) -> Iterator[Metric]:
        """One family per metric, from the current values of the sources."""
        snap = self._snapshot()
        families = {spec.name: family(spec) for spec in n.METRICS}
        _add_transfers(families, snap)
        _add_pools(families, snap.pools)
        if snap.cache is not None:
            _add_cache(families, snap.cache, snap.cache_reasons)
        if snap.background_errors is not None:
            add(families[n.BACKGROUND_ERRORS], {(): snap.background_errors})
        if snap.rank_agreements is not None:
            add(families[n.TP_AGREEMENTS], {(): snap.rank_agreements})
            add(families[n.TP_HELD_OPS], by_label(snap.rank_held_ops, n.TP_HELD_KINDS))
        add(families[n.BUILD_INFO], {(__version__,): 1})
        l3.add_families(families, snap.storage)
        yield from families.values()

    def _snapshot(self) -> _Snapshot:
        sources = self.source_lock if self.source_lock is not None else nullcontext()
        with sources, self._lock:
            if self.source_lock is not None:
                self.histogram.observe_all(self.transfers.drain_durations())
            t = self.transfers
            snap = _Snapshot(
                dict(t.ops_submitted), dict(t.ops_acknowledged), dict(t.tokens),
                dict(t.bytes), dict(t.backend_ops),
                {d: self.histogram.state(d) for d in union(n.DIRECTIONS,
                                                           self.histogram.directions())},
            )
            if self.cache is not None:
                snap.cache = {name: int(getattr(self.cache, name)) for name in _CACHE_SCALARS}
                snap.cache_reasons = {name: dict(getattr(self.cache, name))
                                      for name in _CACHE_REASONS}
            if self.service is not None:
                snap.background_errors = int(self.service.background_errors)
                snap.rank_agreements = int(self.service.rank_agreements)
                snap.rank_held_ops = dict(self.service.rank_held_ops)
            if self.pool_usage is not None:
                snap.pools = [PoolUsage(*row) for row in self.pool_usage()]
            snap.storage = l3.snapshot(None if self.storage is None else self.storage())
        return snap


# ---- building families --------------------------------------------------------------------


def _per_direction_pool(counts: Mapping[tuple[str, str], int], pools: list[str]) -> Labelled:
    directions = union(n.DIRECTIONS, (d for d, _ in counts))
    pools = union(pools, (p for _, p in counts))
    return {(d, p): counts.get((d, p), 0) for d in directions for p in pools}


def _add_transfers(families: dict[str, Metric], snap: _Snapshot) -> None:
    pools = sorted({row.pool for row in snap.pools})
    add(families[n.TRANSFER_TOKENS], _per_direction_pool(snap.tokens, pools))
    add(families[n.TRANSFER_BYTES], _per_direction_pool(snap.bytes, pools))
    add(families[n.TRANSFER_OPS], dict(sorted(snap.backend_ops.items())))
    directions = union(n.DIRECTIONS, [*snap.submitted, *snap.acknowledged])
    add(families[n.TRANSFER_COMPLETED_OPS],
         {(d,): snap.acknowledged.get(d, 0) for d in directions})
    add(families[n.IN_FLIGHT_OPS],
         {(d,): snap.submitted.get(d, 0) - snap.acknowledged.get(d, 0) for d in directions})
    for direction, state in snap.histograms.items():
        add_histogram(families[n.TRANSFER_DURATION], (direction,), state)


def _add_pools(families: dict[str, Metric], rows: list[PoolUsage]) -> None:
    add(families[n.POOL_USED], {(r.tier, r.pool): r.used_tokens for r in rows})
    add(families[n.POOL_CAPACITY], {(r.tier, r.pool): r.total_tokens for r in rows})


def _add_cache(
    families: dict[str, Metric], cache: dict[str, int], reasons: dict[str, dict[str, int]]
) -> None:
    add(families[n.LOOKUP_TOKENS], {(): cache["matched_tokens"]})
    add(families[n.HIT_TOKENS], {("device",): cache["device_hit_tokens"],
                                  ("host",): cache["host_hit_tokens"]})
    add(families[n.INSERTED_TOKENS], {(): cache["inserted_tokens"]})
    add(families[n.DUPLICATE_TOKENS], {(): cache["duplicate_tokens"]})
    add(families[n.EVICTED_TOKENS], {("device",): cache["evicted_device_tokens"],
                                      ("host",): cache["evicted_host_tokens"]})
    add(families[n.LOAD_BACK_TOKENS], {(): cache["loaded_back_tokens"]})
    add(families[n.BACKUP_TOKENS], {(): cache["backed_up_tokens"]})
    add(families[n.DROPPED_TOKENS], by_label(reasons["dropped_tokens"], n.DROP_REASONS))
    add(families[n.REFUSED_LOAD_BACK_TOKENS],
         by_label(reasons["refused_load_backs"], n.LOAD_BACK_REFUSAL_REASONS))
    add(families[n.REFUSED_BACKUP_TOKENS],
         by_label(reasons["refused_backups"], n.BACKUP_REFUSAL_REASONS))
