"""A Redis store's errors name the server's reason, not only that it "does not answer".

A wrong password made ``clear()`` say the server did not answer (the server answered: it
refused the password), and once a circuit was open, a call's error said "circuit open or
refused" without the failure that opened it. Each test starts and stops its own server.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis
from storage_helpers import hashes, make_pool, namespace, needs_redis, views

from hicache.bench.redis_local import RedisServer
from hicache.storage import PageStatus, StorageUnavailable, open_store


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    started = RedisServer(tmp_path / "redis").start()
    yield started
    started.stop()


def _url(server: RedisServer, password: str | None = None) -> str:
    auth = f":{password}@" if password else ""
    return "redis://{}{}:{}".format(auth, *server.address)


@needs_redis
def test_clear_with_a_wrong_password_names_the_refusal(server: RedisServer) -> None:
    redis.Redis(port=server.port).config_set("requirepass", "secret")
    pool = make_pool()
    with (open_store(_url(server, "wrong"), namespace(pool), timeout_s=2.0) as store,
          pytest.raises(StorageUnavailable) as raised):
        store.clear()
    text = str(raised.value)
    assert "does not answer" not in text, text
    assert "WRONGPASS" in text or "invalid" in text, text
    assert "{}:{}".format(*server.address) in text, text
    assert "wrong" not in text.replace("WRONGPASS", ""), text  # never the password itself


@needs_redis
def test_a_call_refused_by_an_open_circuit_names_the_failure_that_opened_it(
        server: RedisServer) -> None:
    redis.Redis(port=server.port).config_set("requirepass", "secret")
    pool = make_pool()
    keys = hashes(2, seed=3)
    with open_store(_url(server, "wrong"), namespace(pool), timeout_s=2.0) as store:
        first = store.get(keys, views(pool, 1, 2))  # the refusal opens the circuit
        second = store.get(keys, views(pool, 1, 2))  # refused by the open circuit
    assert first.statuses == (PageStatus.ERROR,) * 2
    assert second.statuses == (PageStatus.ERROR,) * 2
    for result in (first, second):
        assert result.error is not None and "WRONGPASS" in result.error, result.error
    assert second.error is not None and "circuit" in second.error, second.error


@needs_redis
def test_clear_of_a_stopped_server_names_the_connection_error(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = make_pool()
    with (open_store(f"redis://127.0.0.1:{port}", namespace(pool), timeout_s=1.0) as store,
          pytest.raises(StorageUnavailable) as raised):
        store.clear()
    assert f"127.0.0.1:{port}" in str(raised.value)
    assert "refused" in str(raised.value).lower(), raised.value
