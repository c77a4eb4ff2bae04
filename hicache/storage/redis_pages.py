"""Pages over one Redis connection: ``GET`` straight into host segments, ``SET ... NX`` straight
from them. One call of these runs on one connection in one thread; the store runs several of
them at once (one per stripe of a call's pages, see :mod:`hicache.storage.redis_store`).

Every status a page ends with is written into the shared ``statuses`` list at that page's
position only; a page left ``None`` (the connection failed or the deadline passed first) is
filled in by the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from .base import Deadline, PageStatus, StatsRecorder
from .page_format import PageFormat
from .page_segments import land, landing, payload
from .resp import RespConnection, RespError, bulk_prefix, command

logger = logging.getLogger(__name__)
Statuses = list[PageStatus | None]
_NX_SUFFIX = b"\r\n$2\r\nNX\r\n"


class RedisPages:
    """Reads and writes whole page objects of one format.

    Args:
        format: the page object format (header, checksum).
        stats: where written/skipped pages and bytes are counted.
        window: ``GET`` replies requested ahead on a connection.
        on_redirect: called after a per-page error reply (``MOVED``...): routing is stale.
    """

    def __init__(self, format: PageFormat, stats: StatsRecorder, window: int,
                 on_redirect: Callable[[], None]) -> None:
        self.format = format
        self.window = window
        self._stats = stats
        self._on_redirect = on_redirect

    def get(self, connection: RespConnection, positions: list[int],
            page_hashes: Sequence[bytes], keys: list[bytes], views: list[Sequence[memoryview]],
            statuses: Statuses, corrupt: list[int], deadline: Deadline, replies: list[str]
            ) -> None:
        """``GET`` the pages at ``positions`` into their ``views``; sets their statuses and
        appends corrupt positions to ``corrupt`` (a value of another type at a page's key
        too), and the server's error replies to ``replies``. Raises ``OSError``/``RespError``
        when the connection fails (it must then be closed)."""
        header = memoryview(bytearray(self.format.header_len))
        ahead = min(self.window, len(positions))
        connection.send([b"".join(command(b"GET", keys[i]) for i in positions[:ahead])],
                        deadline)
        for n, i in enumerate(positions):
            try:
                length = connection.read_bulk_length(deadline)
            except RespError as exc:  # MOVED, CLUSTERDOWN, LOADING...: this page only
                if str(exc).startswith("WRONGTYPE"):  # not a page: removed, stored again
                    statuses[i] = PageStatus.CORRUPT
                    corrupt.append(i)
                else:
                    statuses[i] = PageStatus.ERROR
                    self._on_redirect()
                    replies.append(reply_error(connection, exc))
                logger.debug("GET %s: %s", keys[i].decode(), exc)
            else:
                statuses[i] = self._receive(connection, length, page_hashes[i], header,
                                            views[i], deadline)
                if statuses[i] is PageStatus.CORRUPT:
                    corrupt.append(i)
            if n + ahead < len(positions):
                connection.send([command(b"GET", keys[positions[n + ahead]])], deadline)

    def put(self, connection: RespConnection, positions: list[int],
            page_hashes: Sequence[bytes], keys: list[bytes], views: list[Sequence[memoryview]],
            statuses: Statuses, deadline: Deadline, replies: list[str]) -> None:
        """``SET key value NX`` for the pages at ``positions``, all sent before any reply is
        read; a page another writer stored first is ``OK`` (counted as skipped). The
        server's error replies go to ``replies``."""
        prefix_len = self.format.object_len
        for i in positions:
            prefix = bulk_prefix(b"SET", keys[i], value_len=prefix_len, trailing=1)
            page = payload(views[i])  # a layer_first page as one copy (page_segments)
            header = self.format.header(page_hashes[i], page)
            connection.send([prefix, header, *page, _NX_SUFFIX], deadline)
        for i in positions:
            try:
                reply = connection.read_reply(deadline)
            except RespError as exc:  # OOM (maxmemory with noeviction), MOVED...
                statuses[i] = PageStatus.ERROR
                replies.append(reply_error(connection, exc))
                logger.debug("SET of page %s: %s", page_hashes[i].hex()[:16], exc)
                continue
            statuses[i] = PageStatus.OK
            written = reply == b"OK"  # nil: another writer stored it first
            self._stats.add(pages_written=int(written), pages_skipped=int(not written),
                            bytes_written=self.format.payload_len * written)

    def _receive(self, connection: RespConnection, length: int, page_hash: bytes,
                 header: memoryview, segments: Sequence[memoryview], deadline: Deadline
                 ) -> PageStatus:
        if length < 0:
            return PageStatus.MISS
        if length != self.format.object_len:
            connection.skip(length + 2, deadline)
            return PageStatus.CORRUPT
        target = landing(segments)  # a layer_first page lands in one buffer (page_segments)
        connection.read_into([header, *target], deadline)
        connection.expect_crlf(deadline)
        if not self.format.verify(header, page_hash, target):
            return PageStatus.CORRUPT
        land(segments)
        return PageStatus.OK


def fill(statuses: Statuses, positions: list[int], status: PageStatus) -> None:
    """Set the statuses still unset at ``positions`` to ``status``."""
    for i in positions:
        if statuses[i] is None:
            statuses[i] = status


def reply_error(connection: RespConnection, exc: Exception) -> str:
    """A call's error message for the server's error reply ``exc``, naming the server."""
    host, port = connection.address
    return f"redis {host}:{port}: {exc}"
