"""The service's own counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServiceStats:
    """The service's own counters (``background_errors`` is exported as a metric)."""

    background_errors: int = 0
    polls: int = 0
    acks_applied: int = 0
    integrity_checks: int = 0
    integrity_checks_abandoned: int = 0  # background checks given up for a scheduler call
