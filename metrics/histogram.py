"""A plain accumulator of transfer durations per direction, in fixed buckets, and the
:class:`HistogramState` the collector exports (also built from the store's own bucket counts).

The controller keeps only the durations measured since the last drain; this class turns
them into cumulative bucket counts that live as long as the exporter. Not thread-safe: the
exporter calls it under its own lock.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .names import DURATION_BUCKETS_S


class HistogramState(NamedTuple):
    """One direction's histogram: ``cumulative[i]`` counts values ``<= upper_bounds[i]``,
    the last entry (``+Inf``) counts all of them; ``sum_s`` is their total in seconds."""

    upper_bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum_s: float

    @property
    def num_observed(self) -> int:
        """Durations counted (the ``+Inf`` bucket)."""
        return self.cumulative[-1]


def histogram_state(upper_bounds: tuple[float, ...], counts: Sequence[int], sum_s: float
                    ) -> HistogramState:
    """The state of per-bucket ``counts`` (not cumulative; one more than ``upper_bounds``,
    the last for values above every bound) whose values add up to ``sum_s`` seconds."""
    assert len(counts) == len(upper_bounds) + 1, (len(counts), len(upper_bounds))
    return HistogramState(upper_bounds, tuple(itertools.accumulate(counts)), sum_s)


class DurationHistogram:
    """Bucket counts and sums of durations, keyed by direction.

    Args:
        buckets_s: finite upper bounds in seconds, strictly increasing and positive;
            ``+Inf`` is added.
    """

    def __init__(self, buckets_s: Sequence[float] = DURATION_BUCKETS_S) -> None:
        bounds = tuple(float(b) for b in buckets_s)
        if not bounds or any(not math.isfinite(b) or b <= 0 for b in bounds):
            raise ValueError(f"buckets_s must be finite positive seconds, got {list(bounds)}")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"buckets_s must be strictly increasing, got {list(bounds)}")
        self.upper_bounds = bounds
        self._counts: dict[str, list[int]] = {}  # per bucket, not cumulative; last is +Inf
        self._sums: dict[str, float] = {}

    def observe(self, direction: str, seconds: float) -> None:
        """Count one duration of ``direction`` (seconds >= 0)."""
        counts = self._counts.get(direction)
        if counts is None:
            counts = self._counts[direction] = [0] * (len(self.upper_bounds) + 1)
            self._sums[direction] = 0.0
        counts[bisect.bisect_left(self.upper_bounds, seconds)] += 1
        self._sums[direction] += seconds

    def observe_all(self, durations: Iterable[tuple[str, float]]) -> int:
        """Count every ``(direction, seconds)``; returns how many."""
        num = 0
        for direction, seconds in durations:
            self.observe(direction, seconds)
            num += 1
        return num

    def state(self, direction: str) -> HistogramState:
        """The histogram of ``direction`` (all zeros before its first duration)."""
        counts = self._counts.get(direction, [0] * (len(self.upper_bounds) + 1))
        return histogram_state(self.upper_bounds, counts, self._sums.get(direction, 0.0))

    def directions(self) -> list[str]:
        """Directions that have at least one duration, sorted."""
        return sorted(self._counts)
