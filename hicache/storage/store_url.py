"""``open_store``: a backend from a location string (the ``storage:`` config section's form).

- a directory path, or ``file:///abs/path``: :class:`~hicache.storage.FileStore`;
- ``redis://[:password@]host:port``: :class:`~hicache.storage.RedisStore` on one server;
- ``redis+cluster://[:password@]host:port[,host:port...]``: a Redis Cluster, from any nodes.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from .base import StorageBackend
from .file_store import FileStore
from .keys import Namespace
from .redis_nodes import Address
from .redis_store import RedisStore

SCHEMES = ("file", "redis", "redis+cluster")


def open_store(location: str, namespace: Namespace, **options: Any) -> StorageBackend:
    """The backend ``location`` names, for ``namespace``; ``options`` go to its constructor
    (``timeout_s``, ``checksum``; ``capacity_bytes``, ``num_threads``, ``direct_io`` for
    files; ``pipeline_pages`` for Redis). Opens no connection yet.

    Raises:
        ValueError: an unknown scheme, a malformed address, a path that is not a directory.
    """
    if not isinstance(location, str) or not location:
        raise ValueError(f"storage location must be a path or URL, got {location!r}")
    if "://" not in location:
        return FileStore(location, namespace, **options)
    parts = urlsplit(location)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"{location!r}: write file URLs as file:///absolute/path")
        return FileStore(unquote(parts.path), namespace, **options)
    if parts.scheme in ("redis", "redis+cluster"):
        cluster = parts.scheme == "redis+cluster"
        password = unquote(parts.password) if parts.password else None
        hosts = parts.netloc.rsplit("@", 1)[-1]
        seeds = [_address(location, item) for item in hosts.split(",") if item]
        if not seeds:
            raise ValueError(f"{location!r}: no host:port after {parts.scheme}://")
        if len(seeds) > 1 and not cluster:
            raise ValueError(f"{location!r}: several hosts need redis+cluster://")
        if parts.path not in ("", "/", "/0"):
            raise ValueError(f"{location!r}: only database 0 is supported (cluster mode has "
                             "no other); drop the path")
        return RedisStore(seeds, namespace, cluster=cluster, password=password, **options)
    raise ValueError(f"{location!r}: unknown storage scheme {parts.scheme!r}; use a directory "
                     f"path or one of {', '.join(s + '://' for s in SCHEMES)}")


def _address(location: str, item: str) -> Address:
    host, sep, port = item.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{location!r}: {item!r} is not host:port (e.g. 127.0.0.1:6379)")
    return host.strip("[]"), int(port)
