"""The shared store's (L3) metrics: every ``hicache_l3_*`` family is in the first scrape, at
zero, with or without a store and after stop; a backup and a prefetch through the real file
store (in a temporary directory) show their exact counts; each counter of the tier and the
store has its own series; store call latencies land in the buckets their seconds belong to."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_l3_tier import MODEL, fetch, make_config, put, settle

from hicache.config import HiCacheConfig
from hicache.config.storage import StorageConfig
from hicache.controller import TransferStats
from hicache.factory import build_service
from hicache.l3 import PREFETCH_OUTCOMES, StorageTierStats
from hicache.metrics import METRICS, MetricsExporter
from hicache.metrics.names import L3_OPS, L3_PAGE_STATUSES, L3_QUEUES
from hicache.service import HiCacheService
from hicache.storage import PageStatus, StorageResult, StorageStats
from hicache.storage.base import LATENCY_BUCKETS_S, TIMED_OPS, StatsRecorder

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
L3_FAMILIES = {spec.name.removesuffix("_total") for spec in METRICS
               if spec.name.startswith("hicache_l3_")}


def with_metrics(config: HiCacheConfig) -> HiCacheConfig:
    """``config`` with its exporter made (no endpoint is served before ``start``)."""
    service = dataclasses.replace(config.service, metrics_enabled=True, metrics_port=0)
    return dataclasses.replace(config, service=service)


def l3_samples(service: HiCacheService) -> Samples:
    """Every sample of the ``hicache_l3_*`` families of one scrape."""
    assert service.exporter is not None
    families = list(text_string_to_metric_families(service.exporter.render().decode()))
    assert {family.name for family in families} >= L3_FAMILIES
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in families if family.name in L3_FAMILIES for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(f"hicache_l3_{name}", frozenset(labels.items()))]


def nonzero(samples: Samples) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {key: v for key, v in samples.items() if v != 0}


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[HiCacheService, HiCacheService]]:
    """Two services sharing one file store, each with an exporter."""
    a = build_service(with_metrics(make_config(tmp_path / "l3")), **MODEL)
    b = build_service(with_metrics(make_config(tmp_path / "l3")), **MODEL)
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture
def no_store(tmp_path: Path) -> Iterator[HiCacheService]:
    """The same service with ``storage.backend: none``."""
    config = dataclasses.replace(with_metrics(make_config(tmp_path)), storage=StorageConfig())
    service = build_service(config)
    assert service.storage is None
    yield service
    service.stop()


def test_every_l3_series_is_zero_before_any_traffic(two: Any) -> None:
    """A fresh service with a store: every outcome, status, op and queue at 0; enabled 1."""
    samples = l3_samples(two[0])
    assert nonzero(samples) == {("hicache_l3_enabled", frozenset()): 1.0}
    assert {labels for name, labels in samples if name == "hicache_l3_prefetch_tokens_total"} \
        == {frozenset({("outcome", o)}) for o in PREFETCH_OUTCOMES}
    assert {dict(labels)["status"] for name, labels in samples
            if name == "hicache_l3_store_pages_total"} == set(L3_PAGE_STATUSES)
    assert {dict(labels)["op"] for name, labels in samples
            if name == "hicache_l3_store_ops_total"} == set(L3_OPS)
    assert {dict(labels)["queue"] for name, labels in samples
            if name == "hicache_l3_queued_jobs"} == set(L3_QUEUES)
    for op in TIMED_OPS:
        assert value(samples, "store_op_duration_seconds_bucket", op=op, le="+Inf") == 0


def test_without_a_store_the_same_series_are_zero(two: Any, no_store: HiCacheService
                                                  ) -> None:
    """No store: the same series as a fresh service with one, all 0, enabled 0."""
    without, with_store = l3_samples(no_store), l3_samples(two[0])
    assert set(without) == set(with_store)
    assert nonzero(without) == {}


def test_after_stop_the_series_keep_their_counts(two: Any) -> None:
    """stop() closes the tier but keeps it: its stats stay readable (the README's
    ``service.storage.stats``, where a prefetch open at stop counts ``cancelled``), and a
    rendering after stop reads the counts of before, not 0 (a reset to Prometheus)."""
    a, _ = two
    put(a, list(range(100, 120)))
    settle(a)
    before = nonzero(l3_samples(a))
    assert before
    a.stop()
    assert a.storage is not None
    assert a.storage.stats.backup_pages["stored"] == 10
    after = nonzero(l3_samples(a))
    assert {k: v for k, v in after.items() if k in before} == before


def histogram(samples: Samples, op: str) -> tuple[list[float], float, float]:
    """Cumulative bucket counts (in bound order, then +Inf), count and sum of one op."""
    buckets = [value(samples, "store_op_duration_seconds_bucket", op=op, le=str(bound))
               for bound in LATENCY_BUCKETS_S]
    buckets.append(value(samples, "store_op_duration_seconds_bucket", op=op, le="+Inf"))
    return (buckets, value(samples, "store_op_duration_seconds_count", op=op),
            value(samples, "store_op_duration_seconds_sum", op=op))


def assert_one_call(samples: Samples, op: str) -> None:
    """One call of ``op``, in the bucket of the seconds it took (its sum)."""
    buckets, count, seconds = histogram(samples, op)
    first = next(i for i, bound in enumerate(LATENCY_BUCKETS_S) if seconds <= bound)
    assert count == 1 and seconds > 0
    assert buckets == [0.0] * first + [1.0] * (len(buckets) - first)


def without_histograms(samples: Samples) -> dict[str, float]:
    """The non-zero samples that are not latency histograms, as ``name{k=v,...}``."""
    return {name.removeprefix("hicache_l3_") + "".join(f"{{{k}={v}}}" for k, v in sorted(labels)):
            v for (name, labels), v in nonzero(samples).items()
            if "_duration_seconds" not in name}


def test_a_backup_and_a_prefetch_show_their_exact_counts(two: Any) -> None:
    """a backs 10 pages up (one put), b prefetches them (one exists, one get): each scrape
    has exactly those counts, bytes of 10 page payloads, and each call in its bucket."""
    a, b = two
    tokens = list(range(100, 120))
    put(a, tokens)
    settle(a)
    assert a.storage is not None
    page_bytes = a.storage.store.namespace.page_bytes
    samples = l3_samples(a)
    assert without_histograms(samples) == {
        "enabled": 1, "backup_pages_total{outcome=stored}": 10,
        "store_pages_total{status=written}": 10,
        "store_bytes_total{kind=written}": 10 * page_bytes, "store_ops_total{op=put}": 1}
    assert_one_call(samples, "put")
    assert histogram(samples, "get")[1] == histogram(samples, "exists")[1] == 0

    assert fetch(b, tokens)[0] == 20
    samples = l3_samples(b)
    assert without_histograms(samples) == {
        "enabled": 1, "prefetches_total": 1, "queried_tokens_total": 20,
        "found_tokens_total": 20, "prefetch_tokens_total{outcome=used}": 20,
        "store_pages_total{status=found}": 10, "store_pages_total{status=hit}": 10,
        "store_bytes_total{kind=read}": 10 * page_bytes, "store_ops_total{op=exists}": 1,
        "store_ops_total{op=get}": 1}
    assert_one_call(samples, "exists")
    assert_one_call(samples, "get")


def test_corrupt_pages_are_counted_by_the_store_and_the_prefetch(two: Any,
                                                                 tmp_path: Path) -> None:
    """Every stored page damaged: b's get finds 10 corrupt pages, its 20 tokens end as
    ``corrupt``, nothing is read."""
    a, b = two
    tokens = list(range(100, 120))
    put(a, tokens)
    settle(a)
    files = sorted(tmp_path.glob("l3/*/*/*.kv"))
    assert len(files) == 10
    for path in files:
        path.write_bytes(path.read_bytes()[:-1])
    key = b.key(tokens)
    prefetch = b.prefetch(key, b.match(key))
    assert prefetch is not None and b.wait_prefetch(prefetch, timeout_s=10.0)
    assert b.finish_prefetch(prefetch) == 0
    samples = l3_samples(b)
    assert value(samples, "store_pages_total", status="corrupt") == 10
    assert value(samples, "prefetch_tokens_total", outcome="corrupt") == 20
    assert value(samples, "store_pages_total", status="hit") == 0
    assert value(samples, "store_bytes_total", kind="read") == 0
    b.check_integrity()


def test_store_call_latencies_land_in_their_buckets() -> None:
    """A bound counts as ``<=`` it; beyond the last bound is +Inf only; ops are separate;
    the buckets add up to the calls and the seconds to their sum."""
    recorder = StatsRecorder()
    result = StorageResult((PageStatus.OK,))
    for seconds in (0.00005, 0.0003, 0.0003, 20.0):
        recorder.record("get", result, seconds)
    recorder.record("put", result, 0.001)
    stats = recorder.snapshot()
    expected = [0] * (len(LATENCY_BUCKETS_S) + 1)
    expected[0], expected[LATENCY_BUCKETS_S.index(0.0005)], expected[-1] = 1, 2, 1
    assert stats.latency_counts["get"] == tuple(expected)
    assert stats.get_calls == 4 and stats.get_seconds == pytest.approx(20.00065)
    assert sum(stats.latency_counts["put"]) == 1 == stats.put_calls
    assert stats.latency_counts["put"][LATENCY_BUCKETS_S.index(0.001)] == 1
    assert sum(stats.latency_counts["exists"]) == 0


@dataclasses.dataclass
class StubStore:
    """Stands in for a store: returns fixed stats."""

    fixed: StorageStats

    def stats(self) -> StorageStats:
        return self.fixed


@dataclasses.dataclass
class StubTier:
    """Stands in for the tier: fixed counters, queue depths and store."""

    stats: StorageTierStats
    store: StubStore
    queue_depths: dict[str, int]
    write_share_ranks: int = 0


def test_every_counter_lands_in_its_series() -> None:
    """Each tier counter and StorageStats field is exported under its own labels, including
    what the file store never counts (circuits, timeouts, deletes)."""
    tier_stats = StorageTierStats(prefetches=1, queried_tokens=2, found_tokens=3,
                                  backup_evictions=4, worker_errors=5)
    tier_stats.prefetch_tokens.update(timeout=6, host_full=7)
    tier_stats.backup_pages.update(dropped=8)
    fields = ("pages_found", "pages_hit", "pages_missed", "pages_corrupt", "pages_timeout",
              "pages_error", "pages_written", "pages_skipped", "pages_deleted", "pages_evicted",
              "bytes_read", "bytes_written", "bytes_evicted", "exists_calls", "get_calls",
              "put_calls", "delete_calls", "circuit_opens", "open_circuits")
    store = StorageStats(**{name: 10 + i for i, name in enumerate(fields)})
    tier = StubTier(tier_stats, StubStore(store), {"prefetch": 30, "backup": 31}, 32)
    exporter = MetricsExporter(TransferStats(), storage=lambda: tier)
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(exporter.render().decode())
               if family.name in L3_FAMILIES for s in family.samples}
    assert without_histograms(samples) == {
        "enabled": 1, "prefetches_total": 1, "queried_tokens_total": 2,
        "found_tokens_total": 3, "written_back_nodes_total": 4, "worker_errors_total": 5,
        "prefetch_tokens_total{outcome=timeout}": 6,
        "prefetch_tokens_total{outcome=host_full}": 7, "backup_pages_total{outcome=dropped}": 8,
        **{f"store_pages_total{{status={status}}}": 10 + i
           for i, status in enumerate(L3_PAGE_STATUSES)},
        "store_bytes_total{kind=read}": 20, "store_bytes_total{kind=written}": 21,
        "store_bytes_total{kind=evicted}": 22, "store_ops_total{op=exists}": 23,
        "store_ops_total{op=get}": 24, "store_ops_total{op=put}": 25,
        "store_ops_total{op=delete}": 26, "circuit_opens_total": 27, "open_circuits": 28,
        "queued_jobs{queue=prefetch}": 30, "queued_jobs{queue=backup}": 31,
        "write_share_ranks": 32}
