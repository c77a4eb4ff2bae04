"""Building ``prometheus_client`` metric families from :class:`~.names.MetricSpec` rows and
plain values; shared by the collector's parts (transfers and the tree, the shared store)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from .histogram import HistogramState
from .names import MetricSpec

Labelled = Mapping[tuple[str, ...], float]
"""Sample values keyed by their label values, in the order of the spec's labels."""


def family(spec: MetricSpec) -> Metric:
    """An empty family of ``spec``'s type, name, help text and label names."""
    labels = list(spec.labels)
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.description, labels=labels)
    if spec.type == "gauge":
        return GaugeMetricFamily(spec.name, spec.description, labels=labels)
    return HistogramMetricFamily(spec.name, spec.description, labels=labels)


def union(known: Iterable[str], seen: Iterable[str]) -> list[str]:
    """``known`` in order, then the other values of ``seen``, sorted."""
    first = list(known)
    return first + sorted(set(seen) - set(first))


def by_label(counts: Mapping[str, int], known: tuple[str, ...]) -> Labelled:
    """One sample per value of a single label: every ``known`` value (0 when absent from
    ``counts``), then any other value ``counts`` has."""
    return {(value,): counts.get(value, 0) for value in union(known, counts)}


def add(target: Metric, values: Labelled) -> None:
    """Add one sample per entry of ``values`` to a counter or gauge family."""
    assert isinstance(target, CounterMetricFamily | GaugeMetricFamily), target.name
    for labels, value in values.items():
        target.add_metric(list(labels), value)


def add_histogram(target: Metric, labels: tuple[str, ...], state: HistogramState) -> None:
    """Add one labelled histogram (its buckets, ``+Inf``, sum and count) to ``target``."""
    assert isinstance(target, HistogramMetricFamily), target.name
    buckets = [(floatToGoString(bound), float(count))
               for bound, count in zip(state.upper_bounds, state.cumulative[:-1], strict=True)]
    buckets.append(("+Inf", float(state.num_observed)))
    target.add_metric(list(labels), buckets, sum_value=state.sum_s)
