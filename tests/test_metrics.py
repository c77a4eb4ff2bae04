"""Prometheus export on a CPU: exact values scraped over HTTP, per-instance registries, the
endpoint's socket, duration histograms and the metric table (the dashboard: test_deploy.py).

The rig's pools have pages of 2 tokens and 3 layers of K and V rows of 2 float32 elements,
so one token of the ``full`` pool is 48 bytes.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from radix_helpers import HybridRig, Rig

from hicache.config import ServiceConfig, WritePolicy
from hicache.controller import Ack, Direction, TransferStats
from hicache.metrics import (
    DEFAULT_HOST,
    DURATION_BUCKETS_S,
    METRICS,
    MetricsExporter,
    controller_pool_usage,
    markdown_table,
)
from hicache.metrics.names import DIRECTIONS

A = [1, 2, 3, 4, 5, 6, 7, 8]
B = [21, 22, 23, 24, 25, 26]
D2H, H2D = "device_to_host", "host_to_device"
TOKEN_BYTES = 48

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class ServiceCounters:
    """Stands in for the service's counters."""

    background_errors: int = 0
    rank_agreements: int = 0
    rank_held_ops: dict[str, int] = field(default_factory=dict)


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by (sample name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int) -> Samples:
    """GET the endpoint over real HTTP and parse it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return parse(response.read().decode("utf-8"))


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def exporter_of(rig: Rig | HybridRig, service: ServiceCounters | None = None,
                source_lock: threading.Lock | None = None) -> MetricsExporter:
    """An exporter over the rig's controller, tree and pools, as the service wires it."""
    return MetricsExporter(rig.controller.stats, cache=rig.tree.stats,
                           pool_usage=controller_pool_usage(rig.controller),
                           service=service, source_lock=source_lock)


@pytest.fixture
def served() -> Iterator[list[MetricsExporter]]:
    """Exporters appended here are stopped at the end of the test."""
    exporters: list[MetricsExporter] = []
    yield exporters
    for exporter in exporters:
        exporter.stop()


def run_workload(rig: Rig) -> None:
    """Insert A, back it up on its first hit, insert B, evict both (A keeps its host copy,
    B is dropped), hit A on the host and load it back."""
    rig.put(A)
    rig.tree.match_prefix(A)
    assert rig.ack() == 1
    rig.put(B)
    assert rig.tree.evict(len(A) + len(B)) == len(A) + len(B)
    match = rig.tree.match_prefix(A)
    assert rig.tree.load_back(match.last_host_node, device_quota_tokens=100).queued
    rig.tree.start_loading()
    assert rig.ack() == 1
    rig.tree.check_integrity()


# ---- exact values over HTTP ---------------------------------------------------------------


def test_scrape_reports_exact_transfer_and_pool_values(served: list[MetricsExporter]) -> None:
    """Tokens, bytes, ops per backend and pool gauges match the workload exactly."""
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, hits=1)
    exporter = exporter_of(rig)
    served.append(exporter)
    run_workload(rig)
    samples = scrape(exporter.start_http("127.0.0.1", 0))
    for direction in (D2H, H2D):
        assert value(samples, "hicache_transfer_tokens_total", direction=direction,
                     pool="full") == 8
        assert value(samples, "hicache_transfer_bytes_total", direction=direction,
                     pool="full") == 8 * TOKEN_BYTES
        assert value(samples, "hicache_transfer_ops_total", direction=direction,
                     backend="torch") == 1
        assert value(samples, "hicache_transfer_completed_ops_total", direction=direction) == 1
        assert value(samples, "hicache_transfer_in_flight_ops", direction=direction) == 0
    assert value(samples, "hicache_pool_used_tokens", tier="device", pool="full") == 8
    assert value(samples, "hicache_pool_capacity_tokens", tier="device", pool="full") == 24
    assert value(samples, "hicache_pool_used_tokens", tier="host", pool="full") == 8
    assert value(samples, "hicache_pool_capacity_tokens", tier="host", pool="full") == 48


def test_scrape_reports_exact_tree_values(served: list[MetricsExporter]) -> None:
    """Hits by tier, evictions, drops by reason, load-backs and backups match the workload."""
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, hits=1)
    exporter = exporter_of(rig)
    served.append(exporter)
    run_workload(rig)
    samples = scrape(exporter.start_http())
    assert value(samples, "hicache_lookup_tokens_total") == 16
    assert value(samples, "hicache_hit_tokens_total", tier="device") == 8
    assert value(samples, "hicache_hit_tokens_total", tier="host") == 8
    assert value(samples, "hicache_inserted_tokens_total") == 14
    assert value(samples, "hicache_evicted_tokens_total", tier="device") == 14
    assert value(samples, "hicache_evicted_tokens_total", tier="host") == 0
    assert value(samples, "hicache_dropped_tokens_total", reason="no_backup") == 6
    assert value(samples, "hicache_dropped_tokens_total", reason="host_full") == 0
    assert value(samples, "hicache_dropped_tokens_total", reason="orphaned") == 0
    assert value(samples, "hicache_load_back_tokens_total") == 8
    assert value(samples, "hicache_backup_tokens_total") == 8
    assert value(samples, "hicache_refused_load_back_tokens_total", reason="over_quota") == 0


def test_values_are_current_at_every_scrape(served: list[MetricsExporter]) -> None:
    """A later scrape sees later operations and service errors without any refresh call."""
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH)
    service = ServiceCounters()
    exporter = exporter_of(rig, service)
    served.append(exporter)
    port = exporter.start_http()
    before = scrape(port)
    assert value(before, "hicache_transfer_tokens_total", direction=D2H, pool="full") == 0
    assert value(before, "hicache_background_errors_total") == 0
    for direction in (D2H, H2D):  # no op yet in either direction: zeros, not absent
        assert value(before, "hicache_transfer_completed_ops_total", direction=direction) == 0
        assert value(before, "hicache_transfer_in_flight_ops", direction=direction) == 0
    rig.put(A)
    assert value(scrape(port), "hicache_transfer_in_flight_ops", direction=D2H) == 1
    rig.ack()
    service.background_errors += 2
    after = scrape(port)
    assert value(after, "hicache_transfer_tokens_total", direction=D2H, pool="full") == 8
    assert value(after, "hicache_transfer_in_flight_ops", direction=D2H) == 0
    assert value(after, "hicache_pool_used_tokens", tier="host", pool="full") == 8
    assert value(after, "hicache_background_errors_total") == 2


def test_refused_load_back_is_counted_by_reason() -> None:
    """A load-back over the device quota is refused and its tokens counted as ``over_quota``."""
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH)
    exporter = exporter_of(rig)
    rig.put(A)
    rig.ack()
    rig.tree.evict(len(A))
    match = rig.tree.match_prefix(A)
    assert not rig.tree.load_back(match.last_host_node, device_quota_tokens=4).queued
    samples = parse(exporter.render().decode())
    assert value(samples, "hicache_refused_load_back_tokens_total", reason="over_quota") == 8
    assert value(samples, "hicache_load_back_tokens_total") == 0


def test_hybrid_pools_are_labelled_full_and_swa() -> None:
    """A hybrid rig exports both pools on both tiers and SWA transfers under ``pool=swa``."""
    rig = HybridRig()
    exporter = exporter_of(rig)
    rig.put(A)
    rig.ack()
    samples = parse(exporter.render().decode())
    used = {(tier, pool): value(samples, "hicache_pool_used_tokens", tier=tier, pool=pool)
            for tier in ("device", "host") for pool in ("full", "swa")}
    # swa_history all: every SWA row stays on the device and is backed up with its node
    assert used == {("device", "full"): 8, ("device", "swa"): 8,
                    ("host", "full"): 8, ("host", "swa"): 8}
    assert value(samples, "hicache_pool_capacity_tokens", tier="device", pool="swa") == 16
    assert value(samples, "hicache_transfer_tokens_total", direction=D2H, pool="full") == 8
    assert value(samples, "hicache_transfer_tokens_total", direction=D2H, pool="swa") == 8
    assert value(samples, "hicache_transfer_tokens_total", direction=H2D, pool="swa") == 0


# ---- registries and the endpoint ----------------------------------------------------------


def test_exporters_have_separate_registries(served: list[MetricsExporter]) -> None:
    """Two exporters in one process keep their own values; the global registry has none."""
    first, second = Rig(write_policy=WritePolicy.WRITE_THROUGH), Rig()
    exporters = [exporter_of(first), exporter_of(second)]
    served.extend(exporters)
    first.put(A)
    first.ack()
    ports = [exporter.start_http() for exporter in exporters]
    assert ports[0] != ports[1]
    tokens = [value(scrape(port), "hicache_transfer_tokens_total", direction=D2H, pool="full")
              for port in ports]
    assert tokens == [8, 0]
    assert exporters[0].registry is not exporters[1].registry
    assert prometheus_client.REGISTRY.get_sample_value(
        "hicache_transfer_tokens_total", {"direction": D2H, "pool": "full"}) is None


def test_default_host_is_loopback(served: list[MetricsExporter]) -> None:
    """Without a host the endpoint binds 127.0.0.1, as does the default config."""
    exporter = exporter_of(Rig())
    served.append(exporter)
    assert DEFAULT_HOST == ServiceConfig().metrics_host == "127.0.0.1"
    port = exporter.start_http(port=0)
    assert exporter.address == ("127.0.0.1", port) and exporter.port == port > 0


def test_stop_closes_the_socket(served: list[MetricsExporter]) -> None:
    """After stop() nothing listens on the port and the exporter can serve again."""
    exporter = exporter_of(Rig())
    served.append(exporter)
    port = exporter.start_http()
    scrape(port)
    exporter.stop()
    assert exporter.port is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    exporter.stop()  # a second stop is a no-op
    assert scrape(exporter.start_http()) != {}


def test_start_twice_and_bad_port_are_refused(served: list[MetricsExporter]) -> None:
    """A second start_http raises RuntimeError; a port outside 0..65535 raises ValueError."""
    exporter = exporter_of(Rig())
    served.append(exporter)
    for port in (70000, 65536, -1):
        with pytest.raises(ValueError, match=rf"metrics port {port} is not a TCP port; use "
                                             r"0\.\.65535"):
            exporter.start_http(port=port)
    exporter.start_http()
    with pytest.raises(RuntimeError, match="stop"):
        exporter.start_http()


# ---- duration histograms ------------------------------------------------------------------


def timed_ack(stats: TransferStats, direction: Direction, seconds: float | None) -> None:
    """Acknowledge a synthetic op of 2 ``full`` tokens that took ``seconds`` (device-timed)."""
    stats.on_ack(Ack(0, direction, [], {"full": 2}, {"full": 2 * TOKEN_BYTES}, seconds, "torch"))


def histogram_of(samples: Samples, direction: str) -> tuple[list[float], float, float]:
    """(cumulative bucket counts incl. +Inf, count, sum) of one direction."""
    name = "hicache_transfer_duration_seconds"
    bounds = [str(b) for b in DURATION_BUCKETS_S] + ["+Inf"]
    buckets = [value(samples, name + "_bucket", direction=direction, le=b) for b in bounds]
    return (buckets, value(samples, name + "_count", direction=direction),
            value(samples, name + "_sum", direction=direction))


def test_histogram_counts_acked_ops_with_durations() -> None:
    """Counts equal the acknowledged ops that had durations; CPU ops (None) add nothing."""
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH)
    exporter = exporter_of(rig)
    rig.put(A)
    rig.ack()  # a real CPU op: acknowledged, no duration
    stats = rig.controller.stats
    for seconds in (0.0002, 0.0002, 0.003, 20.0):
        timed_ack(stats, Direction.DEVICE_TO_HOST, seconds)
    timed_ack(stats, Direction.HOST_TO_DEVICE, 0.0001)
    timed_ack(stats, Direction.HOST_TO_DEVICE, None)
    assert exporter.refresh() == 5 and stats.durations == []
    samples = parse(exporter.render().decode())
    buckets, count, total = histogram_of(samples, D2H)
    assert count == 4 and total == pytest.approx(20.0034)
    assert buckets == [0, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4]
    buckets, count, _ = histogram_of(samples, H2D)
    assert count == 1 and buckets[0] == 1  # le is inclusive: 100 us lands in le="0.0001"
    assert value(samples, "hicache_transfer_completed_ops_total", direction=D2H) == 5
    assert value(samples, "hicache_transfer_completed_ops_total", direction=H2D) == 2
    timed_ack(stats, Direction.DEVICE_TO_HOST, 0.0002)
    assert histogram_of(parse(exporter.render().decode()), D2H)[1] == 4  # not drained yet
    exporter.refresh()
    assert histogram_of(parse(exporter.render().decode()), D2H)[1] == 5  # cumulative


@pytest.mark.parametrize(("buckets", "message"), [
    ((), "finite positive seconds, got \\[\\]"),
    ((0.001, -1.0), "finite positive seconds, got \\[0.001, -1.0\\]"),
    ((0.0, 1.0), "finite positive seconds"),
    ((0.001, float("inf")), "finite positive seconds"),
    ((float("nan"),), "finite positive seconds"),
    ((0.001, 0.001), "strictly increasing, got \\[0.001, 0.001\\]"),
    ((0.01, 0.001), "strictly increasing"),
], ids=["empty", "negative", "zero", "inf", "nan", "repeated", "decreasing"])
def test_bad_duration_buckets_are_refused(buckets: tuple[float, ...], message: str) -> None:
    """An engine's own histogram bounds are checked when its exporter is made: each must be
    a finite positive number of seconds, the list strictly increasing (``+Inf`` is added)."""
    with pytest.raises(ValueError, match=f"buckets_s must be {message}"):
        MetricsExporter(Rig().controller.stats, duration_buckets_s=buckets)


def test_an_exporters_own_duration_buckets_are_exported() -> None:
    rig = Rig()
    custom = MetricsExporter(rig.controller.stats, duration_buckets_s=(0.5, 2))
    timed_ack(rig.controller.stats, Direction.DEVICE_TO_HOST, 2.0)
    custom.refresh()
    samples = parse(custom.render().decode())
    assert [value(samples, "hicache_transfer_duration_seconds_bucket", direction=D2H, le=le)
            for le in ("0.5", "2.0", "+Inf")] == [0, 1, 1]  # le is inclusive


def test_scrape_drains_durations_under_the_source_lock() -> None:
    """With ``source_lock`` a scrape drains the durations itself, holding that lock."""
    rig = Rig()
    lock = threading.Lock()
    exporter = exporter_of(rig, source_lock=lock)
    with lock:
        timed_ack(rig.controller.stats, Direction.HOST_TO_DEVICE, 0.02)
        exporter.refresh()  # allowed while holding the source lock
        timed_ack(rig.controller.stats, Direction.HOST_TO_DEVICE, 0.04)
    samples = parse(exporter.render().decode())
    _, count, total = histogram_of(samples, H2D)
    assert count == 2 and total == pytest.approx(0.06)
    assert rig.controller.stats.durations == []


# ---- the metric table and the dashboard ---------------------------------------------------


def test_scrape_has_exactly_the_metrics_of_the_table() -> None:
    """Every exported family is in METRICS with its type and labels, and vice versa."""
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH)
    exporter = exporter_of(rig, ServiceCounters())
    rig.put(A)
    rig.ack()
    families = {f.name: f for f in text_string_to_metric_families(exporter.render().decode())}
    specs = {spec.name.removesuffix("_total") if spec.type == "counter" else spec.name: spec
             for spec in METRICS}
    assert set(families) == set(specs)
    for name, family in families.items():
        spec = specs[name]
        assert family.type == spec.type and spec.name.startswith("hicache_")
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(spec.labels), sample
    assert tuple(d.value for d in Direction) == DIRECTIONS


def test_markdown_table_lists_every_metric() -> None:
    """One row per metric, naming its type and labels."""
    table = markdown_table()
    rows = table.strip().splitlines()[2:]
    assert len(rows) == len(METRICS)
    for row, spec in zip(rows, METRICS, strict=True):
        assert row.startswith(f"| `{spec.name}`") and f"| {spec.type} |" in row
        assert all(f"`{label}`" in row for label in spec.labels)
