"""A shared store that stops answering reads (a real Redis server, paused and resumed): the
operator reads one WARNING with the store's reason when prefetch reads start failing and one
INFO when they succeed again, and a prefetch under the ``timeout`` policy gives up at its
deadline rather than at the store's."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_helpers import needs_redis
from test_l3_faults import TOKENS, redis_config, services_on
from test_l3_tier import MODEL, fetch, put, settle

from hicache.bench.redis_local import RedisServer
from hicache.factory import build_service

LOGGER = "hicache.l3.stats"


def store_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level
            and "prefetch reads" in r.getMessage()]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server on a loopback port, resumed and stopped at the end."""
    started = RedisServer(tmp_path / "redis").start()
    yield started
    started.resume()
    started.stop()


@needs_redis
def test_a_paused_store_is_logged_once_and_its_recovery_too(
        server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    a, b = services_on(server)
    try:
        put(a, TOKENS)
        settle(a)
        server.pause()
        for first in (1100, 1200):  # two failing prefetches: one warning
            assert fetch(b, list(range(first, first + 20)))[0] == 0
        warnings = store_lines(caplog, logging.WARNING)
        assert len(warnings) == 1, warnings
        assert "shared store: prefetch reads failed: " in warnings[0]
        assert "timed out" in warnings[0], "the store's own message"
        assert not store_lines(caplog, logging.INFO)
        server.resume()
        deadline = time.monotonic() + 20.0
        while fetch(b, TOKENS)[0] != len(TOKENS):  # misses until the circuit's backoff passed
            assert time.monotonic() < deadline, "reads never reached the resumed server"
            b.evict(10**6)
            b.evict_host(10**6)
            b.step()
            time.sleep(0.2)
        assert store_lines(caplog, logging.INFO) == ["shared store: prefetch reads succeed again"]
        assert len(store_lines(caplog, logging.WARNING)) == 1
    finally:
        a.stop()
        b.stop()


@needs_redis
def test_the_timeout_policy_gives_up_on_a_silent_store_at_its_deadline(server: RedisServer
                                                                        ) -> None:
    """``prefetch_policy: timeout`` (1 s here): not ready while the store is silent and the
    deadline has not passed, ready once it has, though the store's own call (5 s) still
    waits; finished then, nothing is attached and the pages count as timed out."""
    url = "redis://{}:{}".format(*server.address)
    reader = build_service(redis_config(url, prefetch_policy="timeout", prefetch_timeout_s=1.0,
                                        timeout_s=5.0), **MODEL)
    try:
        server.pause()
        key = reader.key(TOKENS)
        prefetch = reader.prefetch(key, reader.match(key))
        assert prefetch is not None
        started = time.monotonic()
        assert not reader.prefetch_ready(prefetch)
        time.sleep(max(0.0, started + 1.2 - time.monotonic()))
        assert reader.prefetch_ready(prefetch), "the deadline passed"
        assert prefetch.found_tokens is None, "the store has not answered"
        assert reader.finish_prefetch(prefetch) == 0
        assert reader.storage is not None
        assert reader.storage.stats.prefetch_tokens["timeout"] == len(TOKENS)
        reader.check_integrity()
    finally:
        server.resume()  # the worker's call returns, and stop does not wait for its timeout
        reader.stop()
