"""Prometheus export of the plain counters hicache's core records.

The only package that imports ``prometheus_client``. :class:`MetricsExporter` owns a
registry per instance and reads its sources (the controller's ``TransferStats``, the tree's
``CacheStats``, pool occupancy, the service's counters and its shared-store tier) on every
scrape;
:data:`METRICS` lists what it exports and :func:`markdown_table` documents it.
"""

from .collector import HiCacheCollector
from .exporter import DEFAULT_HOST, MetricsExporter
from .histogram import DurationHistogram, HistogramState
from .names import DURATION_BUCKETS_S, METRICS, MetricSpec, markdown_table, sample_names
from .sources import (
    CacheSource,
    PoolUsage,
    PoolUsageFn,
    ServiceSource,
    StorageTierFn,
    StorageTierSource,
    TokenAllocator,
    TransferSource,
    allocator_usage,
    controller_pool_usage,
)

__all__ = [
    "DEFAULT_HOST",
    "DURATION_BUCKETS_S",
    "METRICS",
    "CacheSource",
    "DurationHistogram",
    "HiCacheCollector",
    "HistogramState",
    "MetricSpec",
    "MetricsExporter",
    "PoolUsage",
    "PoolUsageFn",
    "ServiceSource",
    "StorageTierFn",
    "StorageTierSource",
    "TokenAllocator",
    "TransferSource",
    "allocator_usage",
    "controller_pool_usage",
    "markdown_table",
    "sample_names",
]
