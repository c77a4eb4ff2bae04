"""The file store: one file per page in a directory (local disk, tmpfs or a shared mount).

Layout: ``<root>/<namespace hex>/<first byte of the hash, hex>/<page hash hex>.kv``. A page
is written to a temporary name beside it and published with ``os.replace``, so a reader sees
the whole object or nothing, on any POSIX file system. The header is padded to 4 KiB, so the
payload can be read with O_DIRECT straight into the host slots (``direct_io``); buffered
reads go through the page cache with ``preadv`` into the same slots, one copy either way.

A size cap (``capacity_bytes``) evicts this namespace's least recently used pages (this
process's view of use, other processes' pages joining it at each scan: :mod:`.file_scan`); a
``put`` never evicts a page it wrote or found written in the same call (``ERROR`` for one
that cannot fit). Threads move a call's pages in parallel, each checking the deadline before
each page; a call returns only when none of them writes into its buffers any more."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .base import (
    DEFAULT_TIMEOUT_S,
    Deadline,
    PageBuffers,
    PageStatus,
    StatsRecorder,
    StorageBackend,
    StorageResult,
    StorageStats,
)
from .file_lru import FileLRU
from .file_scan import Rescans, scan_directory, stale_tmp_age_s
from .host_views import check_batch
from .keys import Namespace
from .page_files import (
    DIRECT_ALIGN,
    aligned,
    create_tmp,
    default_io_threads,
    header_buffer,
    make_directory,
    write_all,
)
from .page_format import PageFormat
from .page_segments import land, landing, payload

logger = logging.getLogger(__name__)
SUFFIX = ".kv"
_O_DIRECT = getattr(os, "O_DIRECT", 0)
BYTES_PER_THREAD = 1 << 20  # a call's pages per I/O thread (small pages' time is Python)


class FileStore(StorageBackend):
    """Pages of one namespace as files under ``root``.

    Args:
        root: a directory (made if missing); several processes may share it.
        namespace: whose pages these are.
        capacity_bytes: cap on this namespace's bytes on disk; ``None``: no cap.
        num_threads: worker threads for ``get``/``put`` (default: half the CPUs, 1 to 4), one
            per MiB of a call's pages at most (a smaller call runs on the caller's thread).
        timeout_s: default deadline of a call.
        checksum: write and verify payload checksums.
        direct_io: read with O_DIRECT (bypassing the page cache) where the segments are
            4 KiB aligned; other pages are read through the page cache.
        fsync: flush each page to the device before publishing it (durable across a power
            loss; a cache does not need it: a torn file fails verification and is a miss).
        rescan_interval_s: with a cap, how often a ``put`` scans the directory again for
            other processes' pages (:class:`~.file_scan.Rescans`; 0: every ``put``).
    """

    def __init__(self, root: str | os.PathLike[str], namespace: Namespace, *,
                 capacity_bytes: int | None = None, num_threads: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, checksum: bool = True,
                 direct_io: bool = False, fsync: bool = False,
                 rescan_interval_s: float = 10.0) -> None:
        num_threads = default_io_threads() if num_threads is None else num_threads
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if direct_io and not _O_DIRECT:
            raise ValueError("direct_io=True needs O_DIRECT, which this platform lacks")
        Deadline(timeout_s)  # validates
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.format = PageFormat(namespace, checksum=checksum, align=DIRECT_ALIGN)
        self.direct_io = direct_io
        self.fsync = fsync
        self.directory = make_directory(Path(root), namespace.hex)
        self._root = str(self.directory)
        self.lru = FileLRU(capacity_bytes)
        self._stats = StatsRecorder()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hicache-file")
        self._num_threads = num_threads
        self._scanned, self._capped = False, capacity_bytes is not None
        self._rescans = Rescans(rescan_interval_s)
        self._scan_lock = threading.Lock()
        self._local, self._tmp_ids = threading.local(), itertools.count()
        self._tmp_prefix = f"{os.getpid()}.{secrets.token_hex(4)}"  # this store's own names
        logger.info("file store %s: cap %s bytes, %d threads, direct_io=%s", self.directory,
                    capacity_bytes, num_threads, direct_io)

    # ---- the interface ---------------------------------------------------------------------

    def exists(self, page_hashes: Sequence[bytes], timeout_s: float | None = None
               ) -> StorageResult:
        check_batch("exists", self.namespace, page_hashes, None, writable=False)
        started, deadline = time.perf_counter(), Deadline(timeout_s or self.timeout_s)
        statuses = []
        for key in page_hashes:
            if deadline.expired():
                statuses.append(PageStatus.TIMEOUT)
            else:
                found = os.path.exists(self._file(key.hex() + SUFFIX))
                statuses.append(PageStatus.OK if found else PageStatus.MISS)
        result = StorageResult(tuple(statuses))
        self._stats.record("exists", result, time.perf_counter() - started)
        return result

    def get(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        views = check_batch("get", self.namespace, page_hashes, pages, writable=True)
        self._scan()
        return self._run("get", page_hashes, views, timeout_s, self._read_page)

    def put(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        views = check_batch("put", self.namespace, page_hashes, pages, writable=False)
        self._scan(rescan=True)
        pinned: list[str] = []  # by this call: written or found written (skipped) by it
        try:
            return self._run("put", page_hashes, views, timeout_s,
                             lambda key, page: self._write_page(key, page, pinned))
        finally:
            self.lru.release(pinned)

    def delete(self, page_hashes: Sequence[bytes], timeout_s: float | None = None
               ) -> StorageResult:
        check_batch("delete", self.namespace, page_hashes, None, writable=False)
        statuses = tuple(PageStatus.OK if self._unlink(key.hex() + SUFFIX) else PageStatus.MISS
                         for key in page_hashes)
        self._stats.add(delete_calls=1, pages_deleted=statuses.count(PageStatus.OK))
        return StorageResult(statuses)

    def clear(self, timeout_s: float | None = None) -> int:
        removed = sum(1 for _ in self.directory.glob(f"*/*{SUFFIX}"))
        with contextlib.suppress(FileNotFoundError):  # removed by hand: nothing to clear
            for child in self.directory.iterdir():
                shutil.rmtree(child, ignore_errors=True)
        self.lru.clear()
        return removed

    def stats(self) -> StorageStats:
        return self._stats.snapshot()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ---- one call, split over the workers ----------------------------------------------------

    def _run(self, op: str, page_hashes: Sequence[bytes], views: list[Sequence[memoryview]],
             timeout_s: float | None, work: Callable[[bytes, Sequence[memoryview]], PageStatus]
             ) -> StorageResult:
        started, deadline = time.perf_counter(), Deadline(timeout_s or self.timeout_s)
        statuses = [PageStatus.TIMEOUT] * len(page_hashes)
        errors: list[str] = []

        def chunk(indices: range) -> None:
            for i in indices:
                if deadline.expired():
                    return
                try:
                    statuses[i] = work(page_hashes[i], views[i])
                except OSError as exc:
                    statuses[i] = PageStatus.ERROR
                    errors.append(f"{op} {page_hashes[i].hex()[:16]}: {exc}")

        payload = len(page_hashes) * self.format.payload_len
        workers = min(self._num_threads, len(page_hashes), payload // BYTES_PER_THREAD)
        if workers <= 1:
            chunk(range(len(page_hashes)))
        else:
            futures = [self._pool.submit(chunk, range(w, len(page_hashes), workers))
                       for w in range(workers)]
            for future in futures:
                future.result()  # each worker stops at the deadline by itself
        result = StorageResult(tuple(statuses), errors[0] if errors else None)
        self._stats.record(op, result, time.perf_counter() - started)
        return result

    def _read_page(self, key: bytes, page: Sequence[memoryview]) -> PageStatus:
        segments = landing(page)  # a layer_first page lands in one buffer (page_segments)
        name = key.hex() + SUFFIX
        path = self._file(name)
        direct = self.direct_io and aligned(segments)
        try:
            fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
        except FileNotFoundError:
            return PageStatus.MISS
        try:
            size = os.fstat(fd).st_size
            header = header_buffer(self._local, self.format.header_len)
            done = os.preadv(fd, [header, *segments], 0) if size == self.format.object_len else 0
        finally:
            os.close(fd)
        if done != self.format.object_len or not self.format.verify(header, key, segments):
            self._unlink(name)
            return PageStatus.CORRUPT
        land(page)
        self._stats.add(bytes_read=self.format.payload_len)
        self._evict(self.lru.touch(name, size))
        return PageStatus.OK

    def _write_page(self, key: bytes, segments: Sequence[memoryview], pinned: list[str]
                    ) -> PageStatus:
        name = key.hex() + SUFFIX
        path = self._file(name)
        if os.path.exists(path):  # pinned: the call's later pages must not evict it
            self._evict(self.lru.pin_existing(name, self.format.object_len))
            pinned.append(name)
            self._stats.add(pages_skipped=1)
            return PageStatus.OK
        victims = self.lru.reserve(name, self.format.object_len)
        if victims is None:
            raise OSError(f"store full: {self.lru.capacity_bytes} bytes cap held by this call")
        pinned.append(name)
        self._evict(victims)
        segments = payload(segments)  # a layer_first page as one copy (page_segments)
        header = self.format.header(key, segments)
        try:
            fd, tmp = self._create_tmp(name)
        except OSError:
            self.lru.remove(name)
            raise
        try:
            try:
                write_all(fd, [memoryview(header), *segments])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            self.lru.remove(name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._stats.add(pages_written=1, bytes_written=self.format.payload_len)
        return PageStatus.OK

    # ---- helpers --------------------------------------------------------------------------

    def _create_tmp(self, name: str) -> tuple[int, str]:
        """A new temporary file beside page ``name`` that no other writer uses."""
        return create_tmp(f"{self._root}/{name[:2]}", f"{name}.{self._tmp_prefix}",
                          self._tmp_ids)

    def _file(self, name: str) -> str:  # a string: Path's work would hold the GIL
        return f"{self._root}/{name[:2]}/{name}"

    def _unlink(self, name: str) -> bool:
        self.lru.remove(name)
        try:
            os.unlink(self._file(name))
            return True
        except FileNotFoundError:
            return False

    def _evict(self, victims: list[tuple[str, int]]) -> None:
        for name, _size in victims:
            try:
                os.unlink(self._file(name))
            except FileNotFoundError:
                continue  # deleted by another process: not an eviction of ours
            except OSError as exc:  # a read-only directory: the file stays (a later scan
                logger.debug("file store %s: cannot evict %s: %s", self.directory, name, exc)
                continue  # indexes it again)
            # payload bytes, as written and read count them (not the file with its header)
            self._stats.add(pages_evicted=1, bytes_evicted=self.format.payload_len)

    def _scan(self, rescan: bool = False) -> None:
        """Index the directory's page files at first use and, with ``rescan`` and a cap, again
        when one is due (:mod:`.file_scan`: other processes' pages count against the cap)."""
        if self._scanned and not (rescan and self._capped and self._rescans.due()):
            return
        with self._scan_lock:
            if self._scanned and not self._rescans.due():
                return
            started = time.monotonic()
            self._evict(self.lru.sync(scan_directory(self._root, SUFFIX,
                                                     stale_tmp_age_s(self.timeout_s))))
            self._rescans.scanned(started)
            self._scanned = True
