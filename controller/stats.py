"""Plain counters the controller keeps; ``hicache.metrics`` reads them. No Prometheus here."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .base import Ack, TransferOp


@dataclass
class TransferStats:
    """Cumulative transfer counts, keyed by ``(direction value, pool name)``.

    ``durations`` holds ``(direction value, seconds)`` of acknowledged ops measured with
    device events, until a consumer calls :meth:`drain_durations`.
    """

    ops_submitted: Counter[str] = field(default_factory=Counter)
    ops_acknowledged: Counter[str] = field(default_factory=Counter)
    tokens: Counter[tuple[str, str]] = field(default_factory=Counter)
    bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    backend_ops: Counter[tuple[str, str]] = field(default_factory=Counter)
    host_runs: Counter[tuple[str, str]] = field(default_factory=Counter)
    host_run_tokens: Counter[tuple[str, str]] = field(default_factory=Counter)
    durations: list[tuple[str, float]] = field(default_factory=list)

    @property
    def in_flight_ops(self) -> int:
        return sum(self.ops_submitted.values()) - sum(self.ops_acknowledged.values())

    def on_submit(self, op: TransferOp) -> None:
        self.ops_submitted[op.direction.value] += 1
        self.backend_ops[(op.direction.value, op.backend)] += 1
        for transfer in op.transfers:
            slots = transfer.host_indices.tensor.numpy()
            if not slots.all():
                slots = slots[slots != 0]
            if slots.size:
                steps = np.diff(slots)
                if (steps < 0).any():  # allocations are ascending: sort only the rare rest
                    steps = np.diff(np.sort(slots))
                key = (op.direction.value, transfer.name)
                self.host_runs[key] += 1 + int(np.count_nonzero(steps != 1))
                self.host_run_tokens[key] += int(slots.size)

    def mean_host_run_tokens(self, direction: str, pool: str) -> float | None:
        """Mean length, in tokens, of the contiguous host-slot runs that ops of ``direction``
        touched in ``pool`` (how fragmented the host free list was; long runs mean long
        copies). ``None`` before any op."""
        runs = self.host_runs[(direction, pool)]
        return self.host_run_tokens[(direction, pool)] / runs if runs else None

    def on_ack(self, ack: Ack) -> None:
        direction = ack.direction.value
        self.ops_acknowledged[direction] += 1
        for pool, num_tokens in ack.tokens_by_pool.items():
            self.tokens[(direction, pool)] += num_tokens
        for pool, size_bytes in ack.bytes_by_pool.items():
            self.bytes[(direction, pool)] += size_bytes
        if ack.duration_s is not None:
            self.durations.append((direction, ack.duration_s))

    def drain_durations(self) -> list[tuple[str, float]]:
        """Return and forget the measured durations."""
        drained, self.durations = self.durations, []
        return drained
