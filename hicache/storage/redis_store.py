"""The Redis store: one value per page on a standalone server or a Redis Cluster.

Key: ``hc1:<namespace hex>:{<page hash hex>}`` (the page hash is the cluster hash tag).
Value: the page object (:mod:`hicache.storage.page_format`), written with ``SET ... NX`` so a
page is never overwritten and a single key can never be half evicted.

Per call and server: ``exists`` and ``delete`` send one pipeline to every server before
reading any reply; ``get`` keeps ``pipeline_pages`` ``GET`` replies in flight and reads
each value straight into its host segments; ``put`` asks which pages exist, then streams the
missing ones from their segments. A server that fails or passes the deadline is dropped
(its connection closed, so nothing writes into the buffers after the call) and its circuit
opens: its pages are ``TIMEOUT``/``ERROR`` now and fail at once until a retry succeeds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from .base import (
    DEFAULT_TIMEOUT_S,
    Deadline,
    PageBuffers,
    PageStatus,
    StatsRecorder,
    StorageBackend,
    StorageResult,
    StorageStats,
    StorageUnavailable,
)
from .host_views import check_batch
from .keys import Namespace
from .page_format import PageFormat
from .redis_nodes import Address, RedisNodes
from .resp import RespConnection, RespError, bulk_prefix, command, scan_unlink

logger = logging.getLogger(__name__)
Statuses = list[PageStatus | None]
NodeWork = Callable[[RespConnection, list[int], Deadline], None]
_NX_SUFFIX = b"\r\n$2\r\nNX\r\n"


class RedisStore(StorageBackend):
    """Pages of one namespace in Redis.

    Args:
        seeds: ``(host, port)`` of the server, or of any cluster nodes.
        namespace: whose pages these are.
        cluster: Redis Cluster (route by slot) instead of one server.
        password: ``AUTH`` password, if the server needs one.
        timeout_s: default deadline of a call.
        checksum: write and verify payload checksums.
        pipeline_pages: ``GET`` replies requested ahead per connection. Deep pipelines of
            large values are slower on loopback (the server copies every reply into its
            output buffer before the client drains it); 4 was the best of 1-16 measured with
            256 KiB-4 MiB pages on a 2-core machine.
        base_backoff_s, max_backoff_s: circuit breaker backoff after a failure.
    """

    def __init__(self, seeds: Sequence[Address], namespace: Namespace, *,
                 cluster: bool = False, password: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, checksum: bool = True,
                 pipeline_pages: int = 4, base_backoff_s: float = 0.1,
                 max_backoff_s: float = 5.0) -> None:
        Deadline(timeout_s)  # validates
        if pipeline_pages < 1:
            raise ValueError(f"pipeline_pages must be >= 1, got {pipeline_pages}")
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.format = PageFormat(namespace, checksum=checksum)
        self.window = pipeline_pages
        self._stats = StatsRecorder()
        self.nodes = RedisNodes(seeds, cluster=cluster, password=password, stats=self._stats,
                                base_backoff_s=base_backoff_s, max_backoff_s=max_backoff_s)
        self.key_prefix = b"hc1:" + namespace.hex.encode() + b":"

    def key(self, page_hash: bytes) -> bytes:
        """The Redis key of a page."""
        return self.key_prefix + b"{" + page_hash.hex().encode() + b"}"

    # ---- the interface ---------------------------------------------------------------------

    def exists(self, page_hashes: Sequence[bytes], timeout_s: float | None = None
               ) -> StorageResult:
        check_batch("exists", self.namespace, page_hashes, None, writable=False)
        started, deadline = time.perf_counter(), Deadline(timeout_s or self.timeout_s)
        statuses, error = self._exists(page_hashes, deadline)
        result = StorageResult(_filled(statuses), error)
        self._stats.record("exists", result, time.perf_counter() - started)
        return result

    def get(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        views = check_batch("get", self.namespace, page_hashes, pages, writable=True)
        started, deadline = time.perf_counter(), Deadline(timeout_s or self.timeout_s)
        keys, corrupt = [self.key(h) for h in page_hashes], list[int]()
        statuses: Statuses = [None] * len(keys)

        def work(connection: RespConnection, positions: list[int], deadline: Deadline) -> None:
            self._get_from(connection, positions, page_hashes, keys, views, statuses, corrupt,
                           deadline)

        error = self._each_node(page_hashes, statuses, deadline, work, None)
        if corrupt and not deadline.expired():
            _, unlink_error = self._pipelined(b"UNLINK", [page_hashes[i] for i in corrupt],
                                              [keys[i] for i in corrupt], deadline)
            if unlink_error:  # best effort: a corrupt page left behind is found again
                logger.warning("could not delete corrupt pages: %s", unlink_error)
        result = StorageResult(_filled(statuses), error)
        self._stats.add(bytes_read=result.count(PageStatus.OK) * self.format.payload_len)
        self._stats.record("get", result, time.perf_counter() - started)
        return result

    def put(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        views = check_batch("put", self.namespace, page_hashes, pages, writable=False)
        started, deadline = time.perf_counter(), Deadline(timeout_s or self.timeout_s)
        found, error = self._exists(page_hashes, deadline)
        statuses: Statuses = [None if s is PageStatus.MISS else s for s in found]
        missing = [i for i, s in enumerate(statuses) if s is None]
        self._stats.add(pages_skipped=found.count(PageStatus.OK))

        def work(connection: RespConnection, positions: list[int], deadline: Deadline) -> None:
            self._put_to(connection, positions, page_hashes, views, statuses, deadline)

        if missing:
            error = self._each_node(page_hashes, statuses, deadline, work, missing) or error
        result = StorageResult(_filled(statuses), error)
        self._stats.record("put", result, time.perf_counter() - started)
        return result

    def delete(self, page_hashes: Sequence[bytes], timeout_s: float | None = None
               ) -> StorageResult:
        check_batch("delete", self.namespace, page_hashes, None, writable=False)
        deadline = Deadline(timeout_s or self.timeout_s)
        keys = [self.key(h) for h in page_hashes]
        statuses, error = self._pipelined(b"UNLINK", page_hashes, keys, deadline)
        result = StorageResult(_filled(statuses), error)
        self._stats.add(delete_calls=1, pages_deleted=result.count(PageStatus.OK))
        return result

    def clear(self, timeout_s: float | None = None) -> int:
        deadline = Deadline(timeout_s or self.timeout_s)
        removed = 0
        for address in self.nodes.masters(deadline):
            connection = self.nodes.connection(address, deadline)
            if connection is None:
                raise StorageUnavailable(f"redis {address[0]}:{address[1]} does not answer")
            try:
                removed += scan_unlink(connection, self.key_prefix + b"*", deadline)
            except (OSError, RespError) as exc:
                self.nodes.failed(address, exc)
                raise StorageUnavailable(f"clearing redis {address[0]}:{address[1]}: "
                                         f"{exc}") from exc
        return removed

    def stats(self) -> StorageStats:
        return self._stats.snapshot()

    def close(self) -> None:
        self.nodes.close()

    # ---- per server --------------------------------------------------------------------------

    def _each_node(self, page_hashes: Sequence[bytes], statuses: Statuses, deadline: Deadline,
                   work: NodeWork, only: list[int] | None) -> str | None:
        """Run ``work`` on each server's share of the pages; pages left unset when a server
        fails become ``TIMEOUT`` (deadline) or ``ERROR``. Returns the first error message."""
        tags = [h.hex().encode() for h in page_hashes]
        wanted = None if only is None else set(only)
        error = None
        for address, positions in self.nodes.group(tags, deadline).items():
            if wanted is not None:
                positions = [i for i in positions if i in wanted]
            if not positions:
                continue
            connection = None if address is None else self.nodes.connection(address, deadline)
            if address is None or connection is None:
                _fill(statuses, positions, PageStatus.ERROR)
                error = error or f"no connection to redis {address} (circuit open or refused)"
                continue
            try:
                work(connection, positions, deadline)
            except (OSError, RespError) as exc:
                status = PageStatus.TIMEOUT if isinstance(exc, TimeoutError) else PageStatus.ERROR
                _fill(statuses, positions, status)
                self.nodes.failed(address, exc)
                error = error or f"redis {address[0]}:{address[1]}: {exc}"
            else:
                self.nodes.succeeded(address)
        return error

    def _exists(self, page_hashes: Sequence[bytes], deadline: Deadline
                ) -> tuple[Statuses, str | None]:
        keys = [self.key(h) for h in page_hashes]
        return self._pipelined(b"EXISTS", page_hashes, keys, deadline)

    def _pipelined(self, verb: bytes, page_hashes: Sequence[bytes], keys: list[bytes],
                   deadline: Deadline) -> tuple[Statuses, str | None]:
        """``verb key`` for every key, one pipeline per server, all sent before any reply is
        read; a reply of 1 is ``OK``, 0 is ``MISS``."""
        statuses: Statuses = [None] * len(keys)
        sent: list[tuple[Address, RespConnection, list[int]]] = []

        def send(connection: RespConnection, positions: list[int], deadline: Deadline) -> None:
            connection.send([b"".join(command(verb, keys[i]) for i in positions)], deadline)
            sent.append((connection.address, connection, positions))

        def read(connection: RespConnection, positions: list[int], deadline: Deadline) -> None:
            for i in positions:
                statuses[i] = _found(connection, deadline)

        error = self._each_node(page_hashes, statuses, deadline, send, None)
        for address, connection, positions in sent:
            error = self._read_node(address, connection, positions, statuses, deadline,
                                    read) or error
        return statuses, error

    def _read_node(self, address: Address, connection: RespConnection, positions: list[int],
                   statuses: Statuses, deadline: Deadline, read: NodeWork) -> str | None:
        try:
            read(connection, positions, deadline)
        except (OSError, RespError) as exc:
            status = PageStatus.TIMEOUT if isinstance(exc, TimeoutError) else PageStatus.ERROR
            _fill(statuses, positions, status)
            self.nodes.failed(address, exc)
            return f"redis {address[0]}:{address[1]}: {exc}"
        return None

    def _get_from(self, connection: RespConnection, positions: list[int],
                  page_hashes: Sequence[bytes], keys: list[bytes],
                  views: list[list[memoryview]], statuses: Statuses, corrupt: list[int],
                  deadline: Deadline) -> None:
        header = memoryview(bytearray(self.format.header_len))
        ahead = min(self.window, len(positions))
        connection.send([b"".join(command(b"GET", keys[i]) for i in positions[:ahead])],
                        deadline)
        for n, i in enumerate(positions):
            try:
                length = connection.read_bulk_length(deadline)
            except RespError as exc:  # MOVED, CLUSTERDOWN, LOADING...: this page only
                statuses[i] = PageStatus.ERROR
                self.nodes.mark_stale()
                logger.debug("GET %s: %s", keys[i].decode(), exc)
            else:
                statuses[i] = self._receive(connection, length, page_hashes[i], header,
                                            views[i], deadline)
                if statuses[i] is PageStatus.CORRUPT:
                    corrupt.append(i)
            if n + ahead < len(positions):
                connection.send([command(b"GET", keys[positions[n + ahead]])], deadline)

    def _receive(self, connection: RespConnection, length: int, page_hash: bytes,
                 header: memoryview, segments: list[memoryview], deadline: Deadline
                 ) -> PageStatus:
        if length < 0:
            return PageStatus.MISS
        if length != self.format.object_len:
            connection.skip(length + 2, deadline)
            return PageStatus.CORRUPT
        connection.read_into([header, *segments], deadline)
        connection.expect_crlf(deadline)
        if self.format.verify(header, page_hash, segments):
            return PageStatus.OK
        return PageStatus.CORRUPT

    def _put_to(self, connection: RespConnection, positions: list[int],
                page_hashes: Sequence[bytes], views: list[list[memoryview]],
                statuses: Statuses, deadline: Deadline) -> None:
        for i in positions:
            key = self.key(page_hashes[i])
            prefix = bulk_prefix(b"SET", key, value_len=self.format.object_len, trailing=1)
            header = self.format.header(page_hashes[i], views[i])
            connection.send([prefix, header, *views[i], _NX_SUFFIX], deadline)
        for i in positions:
            try:
                reply = connection.read_reply(deadline)
            except RespError as exc:  # OOM (maxmemory with noeviction), MOVED...
                statuses[i] = PageStatus.ERROR
                logger.debug("SET of page %s: %s", page_hashes[i].hex()[:16], exc)
                continue
            statuses[i] = PageStatus.OK
            written = reply == b"OK"  # nil: another writer stored it first
            self._stats.add(pages_written=int(written), pages_skipped=int(not written),
                            bytes_written=self.format.payload_len * written)


def _found(connection: RespConnection, deadline: Deadline) -> PageStatus:
    return PageStatus.OK if connection.read_reply(deadline) == 1 else PageStatus.MISS


def _fill(statuses: Statuses, positions: list[int], status: PageStatus) -> None:
    for i in positions:
        if statuses[i] is None:
            statuses[i] = status


def _filled(statuses: Statuses) -> tuple[PageStatus, ...]:
    return tuple(PageStatus.ERROR if s is None else s for s in statuses)
