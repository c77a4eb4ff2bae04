"""The Redis store's stripes: a call's pages moved on several connections by worker threads.
Deadlines against a server that stalls in the middle of every value (nothing is written into
the slots after a call returns), calls queued behind others, concurrent calls on one store."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from storage_helpers import fill, hashes, make_pool, namespace, needs_redis, rows, views

from hicache.bench.redis_local import RedisServer
from hicache.storage import PageStatus, RedisStore

OK, TIMEOUT = PageStatus.OK, PageStatus.TIMEOUT
SLACK_S = 1.0  # scheduling noise on a loaded 2-core machine; a hang would take far longer


class StallingServer:
    """Answers every ``GET`` on every connection with the first half of a value of
    ``value_len`` bytes, then nothing until :meth:`release` sends the rest."""

    def __init__(self, value_len: int) -> None:
        self.value_len = value_len
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.stalled = 0  # connections that sent half a value and wait
        self._released = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._released.set()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        half = self.value_len // 2
        with connection:
            while True:
                received = connection.recv(1 << 16)
                if not received:
                    return  # closed before asking (an empty read would repeat forever)
                if b"GET" in received:
                    break
            connection.sendall(b"$%d\r\n" % self.value_len + b"\xa5" * half)
            with self._lock:
                self.stalled += 1
            self._released.wait()
            try:
                connection.sendall(b"\x5a" * (self.value_len - half) + b"\r\n")
                time.sleep(0.2)
            except OSError:
                pass  # the client closed it: what we want


@pytest.fixture
def stalling() -> Iterator[StallingServer]:
    server = StallingServer(value_len=0)
    yield server
    server.close()


def store_for(address: tuple[str, int], *, num_threads: int, timeout_s: float) -> RedisStore:
    return RedisStore([address], namespace(make_pool()), num_threads=num_threads,
                      timeout_s=timeout_s, base_backoff_s=0.05, max_backoff_s=0.05)


def test_a_deadline_mid_value_on_every_stripe_writes_nothing_after_get_returns(
        stalling: StallingServer) -> None:
    """Four readers stalled mid-value at the deadline: every page TIMEOUT in time, and the
    rest of the values, sent after the call, never reach the slots (a canary survives)."""
    pool = make_pool()
    keys = hashes(8, seed=20)
    with store_for(stalling.address, num_threads=4, timeout_s=0.3) as store:
        stalling.value_len = store.format.object_len
        started = time.monotonic()
        result = store.get(keys, views(pool, 11, 8))
        elapsed = time.monotonic() - started
        assert result.statuses == (TIMEOUT,) * 8 and 0.27 < elapsed < 0.3 + SLACK_S
        assert stalling.stalled == 4
        fill(pool, 10, 10, 7.0)  # the canary, written after the call
        stalling.release()
        time.sleep(0.3)
        assert (rows(pool, 10, 10) == 7.0).all()
        assert store.stats().circuit_opens == 1 and store.stats().pages_timeout == 8


def test_a_call_queued_behind_another_times_out_at_its_own_deadline(
        stalling: StallingServer) -> None:
    """One worker, held by a stalled call with a long deadline: a second call's stripe is
    cancelled at the second call's deadline, and writes nothing after it."""
    pool = make_pool()
    keys = hashes(4, seed=21)
    with store_for(stalling.address, num_threads=1, timeout_s=5.0) as store:
        stalling.value_len = store.format.object_len
        first = threading.Thread(target=store.get, args=(keys[:2], views(pool, 1, 2)))
        first.start()
        deadline = time.monotonic() + 30.0
        while stalling.stalled < 1:
            assert time.monotonic() < deadline, "the first get never reached the server"
            time.sleep(0.01)
        started = time.monotonic()
        result = store.get(keys[2:], views(pool, 11, 2), timeout_s=0.2)
        elapsed = time.monotonic() - started
        assert result.statuses == (TIMEOUT, TIMEOUT) and elapsed < 0.2 + SLACK_S
        assert store.stats().circuit_opens == 0  # the server did not fail this call
        fill(pool, 11, 2, 3.0)
        stalling.release()
        first.join()
        time.sleep(0.2)
        assert (rows(pool, 11, 2) == 3.0).all()


@needs_redis
def test_concurrent_calls_on_one_store_each_get_their_own_pages(
        redis_server: RedisServer) -> None:
    """Four caller threads share two workers: every page arrives bit for bit in its slots."""
    pool = make_pool(num_pages=64)
    keys = [hashes(6, seed=30 + t) for t in range(4)]
    with RedisStore([redis_server.address], namespace(pool), num_threads=2) as store:
        for t in range(4):
            assert store.put(keys[t], views(pool, 1 + 6 * t, 6)).statuses == (OK,) * 6
        fill(pool, 30, 24, 0.0)
        results: list[object] = [None] * 4

        def get(t: int) -> None:
            results[t] = store.get(keys[t], views(pool, 30 + 6 * t, 6)).statuses

        callers = [threading.Thread(target=get, args=(t,)) for t in range(4)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
        assert results == [(OK,) * 6] * 4
        assert torch.equal(rows(pool, 30, 24), rows(pool, 1, 24))
        store.clear()
