"""Sizes of the GPU tests: the full shapes normally, small ones under compute-sanitizer.

``scripts/gpu_check.sh`` sets ``HICACHE_SANITIZER=1`` for its sanitizer runs, where every
kernel launch and every byte a kernel touches is instrumented. A GPU test picks each size that
makes it long (token counts, layers, operations, workload and benchmark sizes) with
:func:`scaled`; the small value keeps the test's edge cases (tile tails, padding pairs, both
layouts, every backend), so only the volume shrinks.
"""

from __future__ import annotations

import os
from typing import TypeVar

SANITIZER_ENV = "HICACHE_SANITIZER"

T = TypeVar("T")


def under_sanitizer() -> bool:
    """True when ``HICACHE_SANITIZER=1``: the suite runs under compute-sanitizer."""
    return os.environ.get(SANITIZER_ENV, "0") == "1"


def scaled(full: T, small: T) -> T:
    """``small`` under the sanitizer (``HICACHE_SANITIZER=1``), else ``full``."""
    return small if under_sanitizer() else full
