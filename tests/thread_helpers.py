"""The service's threads, as the tests see them: only those started by the running test
count, so that a test which left one behind fails alone (see ``conftest.py``) instead of
every later test that looks for one."""

from __future__ import annotations

import threading

SERVICE_THREAD_NAMES = frozenset({"hicache-service", "hicache-metrics-http"})

_before_test: set[threading.Thread] = set()


def note_threads_before_test() -> None:
    """Remember the threads alive now (called by the autouse fixture before each test)."""
    _before_test.clear()
    _before_test.update(threading.enumerate())


def service_threads() -> list[threading.Thread]:
    """The service threads alive now that the running test started."""
    return [thread for thread in threading.enumerate()
            if thread.name in SERVICE_THREAD_NAMES and thread not in _before_test]


def service_thread_names() -> set[str]:
    return {thread.name for thread in service_threads()}
