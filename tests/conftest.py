"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def repo_root() -> Path:
    """The repository root: holds ``config.yaml`` and ``README.md``."""
    return Path(__file__).resolve().parents[1]
