"""The service's own counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServiceStats:
    """The service's own counters (``background_errors`` is exported as a metric)."""

    background_errors: int = 0
    background_passes: int = 0  # the background thread's wakes
    polls: int = 0  # polls of the background thread (a busy scheduler polls itself)
    acks_applied: int = 0
    integrity_checks: int = 0
    integrity_checks_abandoned: int = 0  # background checks given up for a scheduler call
