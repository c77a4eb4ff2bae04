"""The ``storage`` section: the shared store (L3) below the host tier, and its policies.

``backend`` picks the store: ``none`` (no L3, the default), ``file`` (a directory, ``path``)
or ``redis`` (``url`` for one server or ``redis+cluster://``, or ``nodes`` for a cluster).
A key that the chosen backend does not use is an error naming the backend that would use
it, so a config never looks as if it kept pages somewhere it does not. Locations are checked
with :func:`hicache.storage.parse_location`, the parser ``open_store`` uses, so a location
accepted here is one the store opens; nothing is opened or touched while loading.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from hicache.storage import (
    DEFAULT_TIMEOUT_S,
    StoreLocation,
    hide_password,
    parse_address,
    parse_location,
)

from .choices import WritePolicy
from .parse import (
    ConfigError,
    check_gib,
    check_min,
    check_positive,
    check_seconds,
    check_types,
    fail,
)
from .sizing import GIB

_CLUSTER_SCHEME = "redis+cluster://"


class StorageKind(enum.Enum):
    """Which store backs the host tier."""

    NONE = "none"
    FILE = "file"
    REDIS = "redis"


class PrefetchPolicy(enum.Enum):
    """When a prefetch from the store into host slots stops."""

    BEST_EFFORT = "best_effort"
    """At once when the request is scheduled: what arrived by then is used."""
    WAIT_COMPLETE = "wait_complete"
    """When every page found has arrived (each store call is still bounded by timeout_s)."""
    TIMEOUT = "timeout"
    """When every page has arrived or the prefetch timeout of its length has passed."""


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    """The shared store (section ``storage``)."""

    backend: StorageKind = StorageKind.NONE
    """``none`` (no L3), ``file`` or ``redis``."""
    path: str | None = None
    """``file``: the directory of the pages (made if missing; may be a shared mount). ``~`` is
    not expanded (the service may run as another user): write the absolute path."""
    size_cap_gib: float | None = None
    """``file``: cap on the pages' GiB on disk (> 0), least recently used evicted; none: no cap."""
    url: str | None = None
    """``redis``: ``redis://[:password@]host:port`` or ``redis+cluster://host:port,...``."""
    nodes: tuple[str, ...] | None = None
    """``redis``: ``host:port`` of any nodes of a Redis Cluster (instead of ``url``)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Deadline of one store call in seconds (> 0): a slower store is a miss, not a wait."""
    checksum: bool = True
    """Write a checksum of every page and verify it on read."""
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    """When a prefetch into host slots stops: best_effort, wait_complete or timeout."""
    prefetch_timeout_s: float = 2.0
    """``timeout``: seconds a prefetch of any length may take (> 0)."""
    prefetch_timeout_per_1024_tokens_s: float = 0.1
    """``timeout``: seconds added per 1024 tokens prefetched (>= 0)."""
    prefetch_timeout_max_s: float = 30.0
    """``timeout``: the most any prefetch may take, in seconds (>= prefetch_timeout_s)."""
    prefetch_threshold_tokens: int = 256
    """Uncached tails shorter than this (in whole pages) are not asked for (>= 0)."""
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    """When host pages are backed up to the store (after their host backup)."""
    write_through_hits: int = 2
    """Hits before a prefix is backed up under write_through_selective (>= 1)."""

    def __post_init__(self) -> None:
        check_types(self, "storage")  # a section made in Python: its types too
        if self.backend is StorageKind.NONE:
            self._check_unused("storage.backend is none (no L3)", {
                "path": "file", "size_cap_gib": "file", "url": "redis", "nodes": "redis"})
        elif self.backend is StorageKind.FILE:
            self._check_file()
        else:
            self._check_redis()
        check_positive("storage.timeout_s", self.timeout_s)
        check_positive("storage.prefetch_timeout_s", self.prefetch_timeout_s)
        check_min("storage.prefetch_timeout_per_1024_tokens_s",
                  self.prefetch_timeout_per_1024_tokens_s, 0)
        for key in ("timeout_s", "prefetch_timeout_s", "prefetch_timeout_per_1024_tokens_s",
                    "prefetch_timeout_max_s"):
            check_seconds(f"storage.{key}", getattr(self, key))
        if self.prefetch_timeout_max_s < self.prefetch_timeout_s:
            raise fail("storage.prefetch_timeout_max_s", self.prefetch_timeout_max_s,
                        f"below storage.prefetch_timeout_s ({self.prefetch_timeout_s})",
                        f"set it to at least {self.prefetch_timeout_s}")
        check_min("storage.write_through_hits", self.write_through_hits, 1)
        check_min("storage.prefetch_threshold_tokens", self.prefetch_threshold_tokens, 0)

    def _check_unused(self, why: str, users: dict[str, str]) -> None:
        for name, backend in users.items():
            value = getattr(self, name)
            if value is not None:
                raise fail(f"storage.{name}", _hidden(_listed(value)), f"not used: {why}",
                            f"remove it, or set storage.backend: {backend}")

    def _check_file(self) -> None:
        if self.path is None:
            raise ConfigError("storage.path: missing, required for backend file; add the "
                              "directory of the pages (e.g. /var/cache/hicache)",
                              key="storage.path")
        if self.path and not self.path.strip():
            raise fail("storage.path", self.path, "blank", "give the directory of the pages")
        location = _parsed("storage.path", self.path)
        if location.path is None:
            raise fail("storage.path", self.path, "a Redis URL, not a directory",
                        "set storage.backend: redis and url, or give a directory")
        if location.path.startswith("~"):
            raise fail("storage.path", self.path, "'~' is not expanded (it would make a "
                        "directory named '~')", f"write the absolute path, e.g. "
                        f"{os.path.expanduser(location.path)}")
        if self.size_cap_gib is not None:
            check_positive("storage.size_cap_gib", self.size_cap_gib)
            check_gib("storage.size_cap_gib", self.size_cap_gib)
        self._check_unused("backend file keeps pages in storage.path",
                           {"url": "redis", "nodes": "redis"})

    def _check_redis(self) -> None:
        if self.path is not None:
            raise fail("storage.path", self.path, "not used: backend redis keeps pages in the "
                        "server that storage.url or storage.nodes names",
                        "remove it, or set storage.backend: file to keep pages in that directory")
        if self.size_cap_gib is not None:
            raise fail("storage.size_cap_gib", self.size_cap_gib, "not used: the server's "
                        "maxmemory caps a Redis store", "remove it and set maxmemory on the "
                        "server (with maxmemory-policy allkeys-lru)")
        if self.url is not None and self.nodes is not None:
            raise ConfigError(f"storage.url = {_hidden(self.url)!r} and storage.nodes = "
                              f"{list(self.nodes)!r}: both given; keep url (one server, or "
                              f"redis+cluster://...) or nodes (a cluster)", key="storage.url")
        if self.url is None and self.nodes is None:
            raise ConfigError("storage.url: missing, required for backend redis; add url: "
                              "redis://host:6379 (or nodes: [host:port, ...] for a cluster)",
                              key="storage.url")
        if self.url is not None and _parsed("storage.url", self.url).path is not None:
            raise fail("storage.url", _hidden(self.url), "not a Redis URL",
                        "use redis://host:port or redis+cluster://host:port,...; a directory "
                        "goes in storage.path with storage.backend: file")
        if self.nodes is not None:
            self._check_nodes(self.nodes)

    @staticmethod
    def _check_nodes(nodes: tuple[str, ...]) -> None:
        if not nodes:
            raise fail("storage.nodes", [], "no nodes",
                        "list at least one host:port of the cluster")
        for i, node in enumerate(nodes):
            if "://" in node:
                raise fail(f"storage.nodes[{i}]", node, "a URL, not host:port",
                            "write host:port without a scheme, e.g. 10.0.0.1:7000")
            try:
                parse_address(node)
            except ValueError:
                raise fail(f"storage.nodes[{i}]", node, "not host:port",
                            "write it as host:port, e.g. 10.0.0.1:7000") from None
            if node in nodes[:i]:
                raise fail(f"storage.nodes[{i}]", node, "listed twice", "list each node once")
        _parsed("storage.nodes", _CLUSTER_SCHEME + ",".join(nodes))

    @property
    def is_enabled(self) -> bool:
        """True when a store backs the host tier (``backend`` is not ``none``)."""
        return self.backend is not StorageKind.NONE

    @property
    def location(self) -> str | None:
        """What :func:`hicache.storage.open_store` takes: the directory, the URL, or
        ``redis+cluster://`` and the nodes; ``None`` without a store."""
        if self.backend is StorageKind.FILE:
            return self.path
        if self.nodes is not None:
            return _CLUSTER_SCHEME + ",".join(self.nodes)
        return self.url

    @property
    def capacity_bytes(self) -> int | None:
        """The file store's cap in bytes; ``None``: no cap."""
        return None if self.size_cap_gib is None else int(self.size_cap_gib * GIB)

    def prefetch_timeout_for(self, num_tokens: int) -> float:
        """Seconds a ``timeout`` prefetch of ``num_tokens`` tokens may take: ``base +
        per_1024 * num_tokens / 1024``, at most ``prefetch_timeout_max_s``."""
        grown = (self.prefetch_timeout_s
                 + self.prefetch_timeout_per_1024_tokens_s * num_tokens / 1024)
        return min(self.prefetch_timeout_max_s, grown)


def _parsed(key: str, location: str) -> StoreLocation:
    """``parse_location(location)``, its ``ValueError`` made a ``ConfigError`` naming ``key``."""
    if not location:
        raise fail(key, location, "empty", "give a directory path or a URL")
    try:
        return parse_location(location)
    except ValueError as exc:
        hidden = hide_password(location)  # passwords are never printed, hints' forms are
        reason = hide_password(str(exc).removeprefix(f"{location!r}: ").replace(location, hidden),
                               location)
        raise ConfigError(f"{key} = {hidden!r}: {reason}", key=key) from None


def _hidden(value: object) -> object:
    """``value`` with a URL's password shown as ``***`` (passwords are never printed)."""
    return hide_password(value) if isinstance(value, str) else value


def _listed(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value
