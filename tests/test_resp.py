"""The RESP connection against a real ``redis-server``: an empty value is empty bytes and a
missing one nil, an error reply to a bulk read is a :class:`RespError` that leaves the
connection usable, and a reply larger than the connection's line buffer (many short lines)
is read whole."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.bench.redis_local import RedisServer
from hicache.storage.base import Deadline
from hicache.storage.resp import RespConnection, RespError, command


@pytest.fixture
def connection(redis_server: RedisServer) -> Iterator[RespConnection]:
    host, port = redis_server.address
    conn = RespConnection(host, port, Deadline(10.0))
    try:
        yield conn
    finally:
        conn.send([command(b"FLUSHALL")], Deadline(10.0))
        conn.read_reply(Deadline(10.0))
        conn.close()


def ask(conn: RespConnection, *args: bytes) -> object:
    conn.send([command(*args)], Deadline(10.0))
    return conn.read_reply(Deadline(10.0))


def test_an_empty_value_is_empty_bytes_and_a_missing_one_is_nil(connection: RespConnection
                                                                ) -> None:
    assert ask(connection, b"SET", b"empty", b"") == b"OK"
    assert ask(connection, b"GET", b"empty") == b""
    assert ask(connection, b"GET", b"missing") is None
    connection.send([command(b"GET", b"empty")], Deadline(10.0))
    assert connection.read_bulk_length(Deadline(10.0)) == 0
    connection.expect_crlf(Deadline(10.0))  # the empty value's end
    assert ask(connection, b"PING") == b"PONG"


def test_an_error_reply_to_a_bulk_read_leaves_the_connection_usable(connection: RespConnection
                                                                   ) -> None:
    assert ask(connection, b"RPUSH", b"a list", b"x") == 1
    connection.send([command(b"GET", b"a list")], Deadline(10.0))
    with pytest.raises(RespError, match="WRONGTYPE"):
        connection.read_bulk_length(Deadline(10.0))
    assert ask(connection, b"PING") == b"PONG"


def test_a_reply_longer_than_the_line_buffer_is_read_whole(connection: RespConnection
                                                          ) -> None:
    items = [b"item-%06d-" % i + b"x" * (i % 23) for i in range(40_000)]  # about 1 MB
    for first in range(0, len(items), 5000):
        ask(connection, b"RPUSH", b"long", *items[first:first + 5000])
    assert ask(connection, b"LRANGE", b"long", b"0", b"-1") == items
    assert ask(connection, b"LLEN", b"long") == len(items)


def test_a_reply_of_lines_only_past_the_buffer_is_read_whole(connection: RespConnection
                                                             ) -> None:
    """An array of 100,000 integers is lines alone (400 KB; its 9-byte header makes every
    receive end inside a line, so the buffer is never drained): the line buffer fills up
    and moves its unread tail to the front, never splitting a reply."""
    members = [b"m%d" % i for i in range(100_000)]
    ask(connection, b"SADD", b"set", *members[::2])
    assert ask(connection, b"SMISMEMBER", b"set", *members) == [1, 0] * 50_000
