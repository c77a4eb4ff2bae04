"""The shared-store (L3) interface and its small result types.

A :class:`StorageBackend` stores one object per KV page under a chained page hash, inside one
:class:`~hicache.storage.keys.Namespace`. The controller calls it from its worker threads
only (never from the scheduler thread): every call blocks for at most about its deadline and
returns one :class:`PageStatus` per page, so a partial success is usable and one bad page
never raises. Caller mistakes (a wrong buffer size, a read-only destination, an empty batch)
raise ``ValueError``/``TypeError`` at once, before any I/O.

Page buffers: a page is given as a sequence of byte ``memoryview`` segments whose lengths add
up to the namespace's page payload (``Namespace.page_bytes``); ``hicache.storage.host_page_views``
builds them from a host pool's slots. ``get`` writes the object's payload into the segments in
order; ``put`` reads them.
"""

from __future__ import annotations

import abc
import bisect
import enum
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from .keys import Namespace

PageBuffers = Sequence[memoryview]
"""One page: byte segments, written (``get``) or read (``put``) in order."""

DEFAULT_TIMEOUT_S = 2.0

TIMED_OPS: tuple[str, ...] = ("exists", "get", "put")
"""Calls whose latency :class:`StatsRecorder` counts in :data:`LATENCY_BUCKETS_S`."""
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
"""Upper bounds of the call latency buckets, in seconds: 50 us (an ``exists`` on a local
disk) .. 10 s (beyond any deadline)."""


class PageStatus(enum.Enum):
    """Outcome of one page in one call. Only ``OK`` is a hit; everything else is a miss."""

    OK = "ok"
    MISS = "miss"
    CORRUPT = "corrupt"
    TIMEOUT = "timeout"
    ERROR = "error"


class StorageResult(NamedTuple):
    """Per-page outcome of one call, in the order of the keys given.

    ``error`` is the first error message seen (for a log line), ``None`` when there was none.
    """

    statuses: tuple[PageStatus, ...]
    error: str | None = None

    @property
    def num_leading_ok(self) -> int:
        """Pages ``OK`` from the first one up to the first that is not: the usable prefix."""
        for i, status in enumerate(self.statuses):
            if status is not PageStatus.OK:
                return i
        return len(self.statuses)

    def count(self, status: PageStatus) -> int:
        return sum(1 for s in self.statuses if s is status)


@dataclass(frozen=True)
class StorageStats:
    """Cumulative counters of one backend since it was made (a snapshot; read by metrics)."""

    exists_calls: int = 0
    get_calls: int = 0
    put_calls: int = 0
    delete_calls: int = 0
    exists_seconds: float = 0.0
    get_seconds: float = 0.0
    put_seconds: float = 0.0
    pages_found: int = 0
    """``exists``: pages reported present."""
    pages_hit: int = 0
    """``get``: pages loaded and verified."""
    pages_missed: int = 0
    pages_corrupt: int = 0
    """Objects that failed verification (length, header, namespace, hash, checksum); deleted."""
    pages_timeout: int = 0
    pages_error: int = 0
    pages_written: int = 0
    pages_skipped: int = 0
    """``put``: pages already stored, not sent again."""
    pages_deleted: int = 0
    bytes_read: int = 0
    """Payload bytes (the pages' rows, not an object's header) of the pages hit."""
    bytes_written: int = 0
    """Payload bytes of the pages written."""
    pages_evicted: int = 0
    """File store: pages removed by its size cap (a later ``get`` of one is a miss)."""
    bytes_evicted: int = 0
    """Payload bytes of the pages evicted (so ``written - evicted`` is what stays)."""
    circuit_opens: int = 0
    """Redis: times a server's circuit opened (calls to it then fail fast until a retry)."""
    open_circuits: int = 0
    """Redis: servers whose circuit is open now (a gauge)."""
    latency_counts: Mapping[str, tuple[int, ...]] = field(default_factory=dict, hash=False)
    """Calls per latency bucket, for each op of :data:`TIMED_OPS`: entry ``i`` counts calls
    that took more than ``LATENCY_BUCKETS_S[i - 1]`` and at most ``LATENCY_BUCKETS_S[i]``
    seconds, the last entry the slower ones; they add up to ``{op}_calls``, and their time
    is ``{op}_seconds``."""


_COUNTERS = tuple(f.name for f in fields(StorageStats) if f.name != "latency_counts")


class StatsRecorder:
    """Thread-safe counters behind :class:`StorageStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._latency = {op: [0] * (len(LATENCY_BUCKETS_S) + 1) for op in TIMED_OPS}

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._values[name] = value

    def record(self, op: str, result: StorageResult, seconds: float) -> None:
        """Count one ``exists``/``get``/``put`` call, its latency and its pages by status."""
        counts = {status: result.count(status) for status in PageStatus}
        amounts: dict[str, float] = {f"{op}_calls": 1, f"{op}_seconds": seconds,
                                     "pages_corrupt": counts[PageStatus.CORRUPT],
                                     "pages_timeout": counts[PageStatus.TIMEOUT],
                                     "pages_error": counts[PageStatus.ERROR]}
        if op == "exists":
            amounts["pages_found"] = counts[PageStatus.OK]
        elif op == "get":
            amounts["pages_hit"] = counts[PageStatus.OK]
            amounts["pages_missed"] = counts[PageStatus.MISS]
        bucket = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)  # a bound counts as <= it
        with self._lock:  # one lock: a snapshot's buckets always add up to its calls
            for name, amount in amounts.items():
                self._values[name] += amount
            self._latency[op][bucket] += 1

    def snapshot(self) -> StorageStats:
        with self._lock:
            values = dict(self._values)
            latency = {op: tuple(counts) for op, counts in self._latency.items()}
        kinds = {f.name: f.type for f in fields(StorageStats)}
        typed: dict[str, Any] = {name: float(v) if kinds[name] in (float, "float") else int(v)
                                 for name, v in values.items()}
        return StorageStats(**typed, latency_counts=latency)


class Deadline:
    """A point in monotonic time; ``remaining()`` is never negative."""

    def __init__(self, timeout_s: float) -> None:
        if not 0 < timeout_s <= threading.TIMEOUT_MAX:  # longer: a wait raises OverflowError
            raise ValueError(f"timeout_s must be > 0 seconds and at most "
                             f"{threading.TIMEOUT_MAX:g} (the longest wait Python can make), "
                             f"got {timeout_s!r}")
        self.at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at


class StorageBackend(abc.ABC):
    """One namespace of a shared store. Thread-safe; call from worker threads only.

    Every call takes ``timeout_s`` (default: the backend's ``timeout_s``) and returns about
    then at the latest; pages not done by the deadline are ``TIMEOUT``. Page hashes come from
    :func:`hicache.storage.chain_page_hashes`: 32 bytes each.
    """

    namespace: Namespace
    timeout_s: float

    @abc.abstractmethod
    def exists(self, page_hashes: Sequence[bytes], timeout_s: float | None = None
               ) -> StorageResult:
        """Which pages are stored: ``OK`` (present) or ``MISS`` per page, in one batched query.
        ``num_leading_ok`` is how many leading pages a prefetch can ask for. Presence is not
        verification: a page found here can still come back ``CORRUPT`` or ``MISS``."""

    @abc.abstractmethod
    def get(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        """Load pages into ``pages`` (writable segments, see the module docstring).

        A page is ``OK`` only once its whole payload is in its segments and verified; the
        segments of a page that is not ``OK`` hold undefined bytes. When the call returns,
        nothing writes into any segment any more (a timed-out read is abandoned first).
        A corrupt object (any header or checksum mismatch) is ``CORRUPT`` and deleted.
        """

    @abc.abstractmethod
    def put(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        """Store pages from ``pages``, skipping those already stored (``OK`` too, counted in
        ``pages_skipped``). ``OK`` means a later ``get`` finds the page unless it is evicted
        or deleted meanwhile. The segments are only read, and not after the call returns."""

    @abc.abstractmethod
    def delete(self, page_hashes: Sequence[bytes], timeout_s: float | None = None
               ) -> StorageResult:
        """Remove pages: ``OK`` (removed) or ``MISS`` (was not there) per page."""

    @abc.abstractmethod
    def clear(self, timeout_s: float | None = None) -> int:
        """Remove every page of this namespace (other namespaces are untouched); returns how
        many objects were removed. Raises ``StorageUnavailable`` if the store does not answer."""

    @abc.abstractmethod
    def stats(self) -> StorageStats:
        """Cumulative counters (a snapshot)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release threads and connections. Idempotent."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StorageUnavailable(RuntimeError):
    """An admin call (``clear``) could not reach the store."""
