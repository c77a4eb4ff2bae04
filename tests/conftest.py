"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_shapes import SANITIZER_ENV, under_sanitizer
from storage_helpers import own_server, redis_cluster, redis_server  # noqa: F401 (fixtures)


@pytest.fixture
def repo_root() -> Path:
    """The repository root: holds ``config.yaml`` and ``README.md``."""
    return Path(__file__).resolve().parents[1]


def pytest_report_header() -> str | None:
    """Say so when the GPU tests run at their small shapes (``tests/gpu_shapes.py``)."""
    if under_sanitizer():
        return f"{SANITIZER_ENV}=1: GPU tests use their small (sanitizer) shapes"
    return None
