"""A small RESP2 client connection: pipelined commands out, replies in, bulk values received
straight into the caller's buffers.

This is the Redis data path. A general client (redis-py with hiredis) parses a 2 MiB value
into a new ``bytes`` object that the caller then copies into the host slot; here the bytes go
from the socket into the slot by ``recv_into`` (one copy, done by the kernel), and a page is
sent from the slot by ``sendmsg`` of the header and the slot's segments (no copy in Python).

Every blocking operation takes a :class:`~hicache.storage.base.Deadline`: the socket's timeout
is set to what remains, so nothing waits past it. After a timeout or a connection error the
connection's state is unknown and it must be closed (the caller does).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from .base import Deadline

Reply = int | bytes | list["Reply"] | None
_BUFFER_BYTES = 1 << 18
_MAX_IOV = 512
_LINE_READ_BYTES = 4096


class RespError(Exception):
    """An error reply from the server (``-ERR ...``, ``-MOVED ...``): the command failed, the
    connection is still usable."""


class RespConnection:
    """One TCP connection to one server. Not thread-safe: one per thread.

    Raises ``OSError`` (``TimeoutError`` included) on connect, and later on any I/O failure.
    """

    def __init__(self, host: str, port: int, deadline: Deadline,
                 password: str | None = None) -> None:
        self.address = (host, port)
        self.sock = socket.create_connection(self.address, timeout=max(deadline.remaining(),
                                                                       1e-3))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        self.closed = False
        if password is not None:
            self.send([command(b"AUTH", password.encode())], deadline)
            self.read_reply(deadline)

    def peer_closed(self) -> bool:
        """Whether the server closed this idle connection (its idle ``timeout``, a restart,
        a protocol error): an end of file, or an error, waiting to be read. No wait: every
        operation sets its own timeout again."""
        try:
            self.sock.settimeout(0)
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read: open
        except OSError:
            return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    # ---- sending ---------------------------------------------------------------------------

    def send(self, parts: Sequence[bytes | memoryview], deadline: Deadline) -> None:
        """Send every byte of ``parts`` in order (``sendmsg``, a few hundred buffers a call)."""
        pending = [memoryview(p) for p in parts if len(p)]
        first = 0
        while first < len(pending):
            self._wait(deadline)
            sent = self.sock.sendmsg(pending[first:first + _MAX_IOV])
            while first < len(pending) and sent >= pending[first].nbytes:
                sent -= pending[first].nbytes
                first += 1
            if sent:
                pending[first] = pending[first][sent:]

    # ---- receiving -------------------------------------------------------------------------

    def read_reply(self, deadline: Deadline) -> Reply:
        """One whole reply; raises :class:`RespError` for an error reply (after consuming it)."""
        line = self._read_line(deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            data = bytearray(length + 2)
            self.read_into([memoryview(data)], deadline)
            return bytes(data[:length])
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [self.read_reply(deadline) for _ in range(count)]
        if kind == b"-":
            raise RespError(rest.decode("utf-8", "replace"))
        raise ConnectionError(f"protocol error from {self.address}: {line[:40]!r}")

    def read_bulk_length(self, deadline: Deadline) -> int:
        """The length of the next bulk reply (``-1`` for nil); its bytes (and the trailing
        CRLF) are then read with :meth:`read_into` / :meth:`skip`."""
        line = self._read_line(deadline)
        if line[:1] == b"$":
            return int(line[1:])
        if line[:1] == b"-":
            raise RespError(line[1:].decode("utf-8", "replace"))
        raise ConnectionError(f"expected a bulk reply from {self.address}, got {line[:40]!r}")

    def read_into(self, targets: Sequence[memoryview], deadline: Deadline) -> None:
        """Fill ``targets`` in order: first from what is buffered, then by ``recv_into``."""
        for target in targets:
            size = target.nbytes
            buffered = min(size, self._end - self._start)
            if buffered:
                target[:buffered] = self._view[self._start:self._start + buffered]
                self._start += buffered
            done = buffered
            while done < size:
                self._wait(deadline)
                received = self.sock.recv_into(target[done:], size - done)
                if received == 0:
                    raise ConnectionError(f"server {self.address} closed the connection")
                done += received

    def skip(self, size: int, deadline: Deadline) -> None:
        """Discard the next ``size`` bytes."""
        scratch = bytearray(min(size, _BUFFER_BYTES))
        while size:
            part = min(size, len(scratch))
            self.read_into([memoryview(scratch)[:part]], deadline)
            size -= part

    def expect_crlf(self, deadline: Deadline) -> None:
        """Consume the CRLF after a bulk value, buffering what follows it (usually the next
        reply's length line: one receive for both)."""
        while self._end - self._start < 2:
            self._fill(deadline)
        if self._buffer[self._start:self._start + 2] != b"\r\n":
            raise ConnectionError(f"protocol error from {self.address}: bulk not ended by CRLF")
        self._start += 2

    def _read_line(self, deadline: Deadline) -> bytes:
        while True:
            end = self._buffer.find(b"\r\n", self._start, self._end)
            if end >= 0:
                line = bytes(self._view[self._start:end])
                self._start = end + 2
                return line
            self._fill(deadline)

    def _fill(self, deadline: Deadline) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            if self._start == 0:
                raise ConnectionError(f"reply line from {self.address} longer than "
                                      f"{len(self._buffer)} bytes")
            pending = self._end - self._start
            self._buffer[:pending] = self._view[self._start:self._end]
            self._start, self._end = 0, pending
        self._wait(deadline)
        # A small receive: what follows a line is mostly a value, better received in place.
        received = self.sock.recv_into(self._view[self._end:self._end + _LINE_READ_BYTES])
        if received == 0:
            raise ConnectionError(f"server {self.address} closed the connection")
        self._end += received

    def _wait(self, deadline: Deadline) -> None:
        remaining = deadline.remaining()
        if remaining <= 0:
            raise TimeoutError(f"deadline passed talking to {self.address}")
        self.sock.settimeout(remaining)


def command(*args: bytes) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def bulk_prefix(*args: bytes, value_len: int, trailing: int = 0) -> bytes:
    """The bytes before a large value sent separately: ``*N``, the small ``args`` before it,
    and the value's ``$len`` line (``trailing`` small arguments follow the value)."""
    parts = [b"*%d\r\n" % (len(args) + 1 + trailing)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    parts.append(b"$%d\r\n" % value_len)
    return b"".join(parts)


def scan_unlink(connection: RespConnection, pattern: bytes, deadline: Deadline) -> int:
    """``UNLINK`` every key of one server matching ``pattern``; returns how many."""
    cursor, removed = b"0", 0
    while True:
        connection.send([command(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"1000")],
                        deadline)
        reply = connection.read_reply(deadline)
        assert isinstance(reply, list) and len(reply) == 2, f"SCAN replied {reply!r:.80}"
        next_cursor, found = reply
        assert isinstance(next_cursor, bytes) and isinstance(found, list), "SCAN reply shape"
        cursor = next_cursor
        if found:
            connection.send([b"".join(command(b"UNLINK", k) for k in found
                                      if isinstance(k, bytes))], deadline)
            removed += sum(int(connection.read_reply(deadline) == 1) for _ in found)
        if cursor == b"0":
            return removed
