"""The local ``redis-server`` helper the storage tests and ``hicache bench storage`` start:
its ports stay out of the kernel's ephemeral range, a port taken between the pick and the
bind is picked again, and a port the caller chose is never changed."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_helpers import needs_redis

from hicache.bench import redis_local
from hicache.bench.redis_local import (
    RedisCluster,
    RedisServer,
    _ephemeral_low,
    free_port,
    have_redis,
    ping,
)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A loopback socket listening on no port yet; the test binds it."""
    sock = socket.socket()
    yield sock
    sock.close()


def take(sock: socket.socket, port: int) -> None:
    sock.bind(("127.0.0.1", port))
    sock.listen()


def test_free_ports_and_their_bus_ports_lie_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    for _ in range(50):
        port = free_port()
        assert port >= 10000 and port + 10000 < low, (port, low)


def test_a_port_whose_bus_port_is_taken_is_not_picked(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """Only ports below 25000 are free here: a pick's cluster bus port (+10000) must be one
    of them too, so every pick is below 15000; with nothing free the pick gives up."""
    monkeypatch.setattr(redis_local, "_ephemeral_low", lambda: 32768)
    monkeypatch.setattr(redis_local, "_is_free", lambda port: port < 25_000)
    picks = [free_port() for _ in range(50)]
    assert all(10_000 <= port < 15_000 for port in picks), picks
    monkeypatch.setattr(redis_local, "_is_free", lambda port: False)
    with pytest.raises(RuntimeError, match="no free loopback port pair found"):
        free_port()


def test_redis_is_found_only_with_both_its_programs(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``have_redis`` needs ``redis-server`` and ``redis-cli`` on the PATH: neither, or the
    server alone, is not enough (the Redis tests would then be skipped, not failed)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not have_redis()
    server = tmp_path / "redis-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    assert not have_redis()
    cli = tmp_path / "redis-cli"
    cli.write_text("#!/bin/sh\n")
    cli.chmod(0o755)
    assert have_redis()


@needs_redis
def test_a_picked_port_taken_before_the_start_is_picked_again(
        tmp_path: Path, listener: socket.socket) -> None:
    server = RedisServer(tmp_path / "redis")
    taken = server.port
    take(listener, taken)
    server.start()
    try:
        assert server.port != taken
        assert ping(server.port).startswith(b"+PONG")
    finally:
        server.stop()


@needs_redis
def test_a_chosen_port_that_is_taken_fails_with_the_servers_log(
        tmp_path: Path, listener: socket.socket) -> None:
    port = free_port()
    take(listener, port)
    server = RedisServer(tmp_path / "redis", port=port)
    with pytest.raises(RuntimeError, match=rf"redis-server on port {port} did not start "
                       r"\(see .*\): .*(in use|bind)"):
        server.start()
    assert server.port == port and server.process is None


@needs_redis
def test_a_server_that_answered_keeps_its_port_across_a_restart(
        tmp_path: Path, listener: socket.socket) -> None:
    server = RedisServer(tmp_path / "redis").start()
    port = server.port
    server.kill()
    take(listener, port)
    with pytest.raises(RuntimeError, match=f"port {port} did not start"):
        server.start()
    assert server.port == port
    listener.close()
    server.start()
    try:
        assert server.port == port and ping(port).startswith(b"+PONG")
    finally:
        server.stop()


def test_the_nodes_of_a_cluster_get_distinct_ports(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    picks = iter([21000, 21000, 21000, 21001, 21001, 21002])
    monkeypatch.setattr("hicache.bench.redis_local.free_port", lambda: next(picks))
    cluster = RedisCluster(tmp_path)
    assert [s.port for s in cluster.servers] == [21000, 21001, 21002]
