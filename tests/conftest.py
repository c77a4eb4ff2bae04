"""Fixtures shared by the test modules."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpu_shapes import SANITIZER_ENV, under_sanitizer
from storage_helpers import own_server, redis_cluster, redis_server  # noqa: F401 (fixtures)
from thread_helpers import note_threads_before_test, service_threads


@pytest.fixture
def repo_root() -> Path:
    """The repository root: holds ``config.yaml`` and ``README.md``."""
    return Path(__file__).resolve().parents[1]


@pytest.fixture
def default_dict(repo_root: Path) -> dict[str, Any]:
    """config.yaml as a dict, with the metrics endpoint off (tests open no port)."""
    data: dict[str, Any] = yaml.safe_load((repo_root / "config.yaml").read_text())
    data["service"]["metrics_enabled"] = False
    return data


def pytest_report_header() -> str | None:
    """Say so when the GPU tests run at their small shapes (``tests/gpu_shapes.py``)."""
    if under_sanitizer():
        return f"{SANITIZER_ENV}=1: GPU tests use their small (sanitizer) shapes"
    return None


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_raises() -> Iterator[None]:
    """A session started with SIGINT ignored (the background job of a non-interactive shell,
    ``nohup``) runs as one started in the foreground: the interpreter then installs no
    ``KeyboardInterrupt`` handler, so the Ctrl-C tests' interrupts would do nothing, and the
    programs the terminal tests start would inherit the ignored signal."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(autouse=True)
def no_service_thread_left_behind() -> Iterator[None]:
    """A test that leaves a service thread running (a service never stopped) fails at its
    teardown, naming the threads; later tests do not count that thread as theirs."""
    note_threads_before_test()
    yield
    deadline = time.monotonic() + 5.0  # a stop in another thread may still be joining
    while service_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    left = service_threads()
    assert not left, f"the test left {[t.name for t in left]} running: stop its service"
