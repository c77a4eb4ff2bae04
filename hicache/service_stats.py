"""The service's own counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.metrics.names import TP_HELD_KINDS


@dataclass
class ServiceStats:
    """The service's own counters (``background_errors`` is exported as a metric)."""

    background_errors: int = 0
    background_passes: int = 0  # the background thread's wakes
    polls: int = 0  # polls of the background thread (a busy scheduler polls itself)
    acks_applied: int = 0
    integrity_checks: int = 0
    integrity_checks_abandoned: int = 0  # background checks given up for a scheduler call
    rank_agreements: int = 0  # steps agreed with the other tensor-parallel ranks
    # after the last step of a tensor-parallel rank: acks finished here that not every
    # rank has finished, and store jobs not yet agreed back, by TP_HELD_KINDS
    rank_held_ops: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(TP_HELD_KINDS, 0))
