"""The Redis store: one value per page on a standalone server or a Redis Cluster.

Key: ``hc1:<namespace hex>:{<page hash hex>}`` (the page hash is the cluster hash tag).
Value: the page object (:mod:`hicache.storage.page_format`), written with ``SET ... NX`` so a
page is never overwritten and a single key can never be half evicted.

Per call and server: ``exists`` and ``delete`` send one pipeline to every server before
reading any reply. ``get`` and ``put`` split each server's pages into up to ``num_threads``
stripes, each moved on its own connection by a worker thread (socket I/O releases the GIL,
and a single-threaded server writes to several clients per event-loop turn): ``get`` keeps
``pipeline_pages`` ``GET`` replies in flight per connection and reads each value straight
into its host segments; ``put`` asks which pages exist, then streams the missing ones from
their segments. A call returns only when every stripe has returned: a stripe not started by
the deadline is cancelled, a running one stops at it (its socket's timeout is what remains),
so nothing writes into the buffers after the call. A server that fails or passes the
deadline is dropped (the connections closed) and its circuit opens, once per call: its pages
are ``TIMEOUT``/``ERROR`` now and fail at once until a retry succeeds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

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
from .redis_pages import RedisPages, Statuses, fill
from .redis_stripes import NodeWork, Stripes
from .resp import RespConnection, RespError, command, scan_unlink

logger = logging.getLogger(__name__)


class RedisStore(StorageBackend):
    """Pages of one namespace in Redis.

    Args:
        seeds: ``(host, port)`` of the server, or of any cluster nodes.
        namespace: whose pages these are.
        cluster: Redis Cluster (route by slot) instead of one server.
        password: ``AUTH`` password, if the server needs one.
        timeout_s: default deadline of a call.
        checksum: write and verify payload checksums.
        num_threads: worker threads, and connections per server a ``get``/``put`` spreads
            its pages over (shared by the servers of a cluster and by concurrent calls).
        pipeline_pages: ``GET`` replies requested ahead per connection (with 4 connections,
            1, 2 and 4 measured the same; deep pipelines of large values are slower: the
            server copies every reply into its output buffer before the client drains it).
        base_backoff_s, max_backoff_s: circuit breaker backoff after a failure.
    """

    def __init__(self, seeds: Sequence[Address], namespace: Namespace, *,
                 cluster: bool = False, password: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, checksum: bool = True,
                 num_threads: int = 4, pipeline_pages: int = 2, base_backoff_s: float = 0.1,
                 max_backoff_s: float = 5.0) -> None:
        Deadline(timeout_s)  # validates
        if pipeline_pages < 1:
            raise ValueError(f"pipeline_pages must be >= 1, got {pipeline_pages}")
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.format = PageFormat(namespace, checksum=checksum)
        self._stats = StatsRecorder()
        self.nodes = RedisNodes(seeds, cluster=cluster, password=password, stats=self._stats,
                                base_backoff_s=base_backoff_s, max_backoff_s=max_backoff_s)
        self.pages = RedisPages(self.format, self._stats, pipeline_pages, self.nodes.mark_stale)
        self.key_prefix = b"hc1:" + namespace.hex.encode() + b":"
        self.stripes = Stripes(self.nodes, num_threads)

    def key(self, page_hash: bytes) -> bytes:
        """The Redis key of a page."""
        return self.key_prefix + b"{" + page_hash.hex().encode() + b"}"

    # ---- the interface ---------------------------------------------------------------------

    def exists(self, page_hashes: Sequence[bytes], timeout_s: float | None = None
               ) -> StorageResult:
        check_batch("exists", self.namespace, page_hashes, None, writable=False)
        started, deadline = time.perf_counter(), Deadline(timeout_s or self.timeout_s)
        keys = [self.key(h) for h in page_hashes]
        statuses, error = self._pipelined(b"EXISTS", page_hashes, keys, deadline)
        result = StorageResult(_filled(statuses), error)
        self._stats.record("exists", result, time.perf_counter() - started)
        return result

    def get(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        views = check_batch("get", self.namespace, page_hashes, pages, writable=True)
        started, deadline = time.perf_counter(), Deadline(timeout_s or self.timeout_s)
        keys, corrupt, replies = [self.key(h) for h in page_hashes], list[int](), list[str]()
        statuses: Statuses = [None] * len(keys)

        def work(connection: RespConnection, positions: list[int], deadline: Deadline) -> None:
            self.pages.get(connection, positions, page_hashes, keys, views, statuses, corrupt,
                           deadline, replies)

        error = self.stripes.run(page_hashes, statuses, deadline, work, None)
        error = error or (replies[0] if replies else None)  # a page's own error reply
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
        keys = [self.key(h) for h in page_hashes]
        found, error = self._pipelined(b"EXISTS", page_hashes, keys, deadline)
        statuses: Statuses = [None if s is PageStatus.MISS else s for s in found]
        missing = [i for i, s in enumerate(statuses) if s is None]
        self._stats.add(pages_skipped=found.count(PageStatus.OK))

        replies: list[str] = []

        def work(connection: RespConnection, positions: list[int], deadline: Deadline) -> None:
            self.pages.put(connection, positions, page_hashes, keys, views, statuses, deadline,
                           replies)

        if missing:
            error = self.stripes.run(page_hashes, statuses, deadline, work, missing) or error
            error = error or (replies[0] if replies else None)  # a page's own error reply
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
        masters = self.nodes.masters(deadline)
        if not masters:  # no slot map: no node answered (nothing was cleared)
            raise StorageUnavailable(f"no node of the redis cluster answers (seeds "
                                     f"{self.nodes.seeds})")
        for address in masters:
            connection = self.nodes.connection(address, deadline)
            if connection is None:
                raise StorageUnavailable(f"clearing {self.nodes.unreachable(address)}")
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
        self.stripes.close()
        self.nodes.close()

    # ---- per server --------------------------------------------------------------------------

    def _each_node(self, page_hashes: Sequence[bytes], statuses: Statuses, deadline: Deadline,
                   work: NodeWork) -> str | None:
        """Run ``work`` on each server's share of the pages in this thread, one after the
        other; pages left unset when a server fails become ``TIMEOUT`` (deadline) or
        ``ERROR``. Returns the first error message."""
        error = None
        tags = [h.hex().encode() for h in page_hashes]
        for address, positions in self.nodes.group(tags, deadline).items():
            connection = None if address is None else self.nodes.connection(address, deadline)
            if address is None or connection is None:
                fill(statuses, positions, PageStatus.ERROR)
                error = error or self.nodes.unreachable(address)
                continue
            error = self._read_node(address, connection, positions, statuses, deadline,
                                    work) or error
        return error

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
                try:
                    statuses[i] = _found(connection, deadline)
                except RespError as exc:  # MOVED, ASK, TRYAGAIN: this key only, the rest read
                    statuses[i] = PageStatus.ERROR
                    self.nodes.mark_stale()
                    logger.debug("%s %s: %s", verb.decode(), keys[i].decode(), exc)

        error = self._each_node(page_hashes, statuses, deadline, send)
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
            fill(statuses, positions, status)
            self.nodes.failed(address, exc)
            return f"redis {address[0]}:{address[1]}: {exc}"
        self.nodes.succeeded(address)
        return None


def _found(connection: RespConnection, deadline: Deadline) -> PageStatus:
    return PageStatus.OK if connection.read_reply(deadline) == 1 else PageStatus.MISS


def _filled(statuses: Statuses) -> tuple[PageStatus, ...]:
    return tuple(PageStatus.ERROR if s is None else s for s in statuses)
