"""``open_store``: a backend from a location string (the ``storage:`` config section's form).

- a directory path, or ``file:///abs/path``: :class:`~hicache.storage.FileStore`;
- ``redis://[:password@]host:port``: :class:`~hicache.storage.RedisStore` on one server;
- ``redis+cluster://[:password@]host:port[,host:port...]``: a Redis Cluster, from any nodes.

A Redis URL with a user name, a query (``?db=2``) or a fragment is refused: the store would
ignore them.

:func:`parse_location` is the one parser of these strings: ``open_store`` and the config's
checks both use it, so a location the config accepts is one ``open_store`` opens.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple
from urllib.parse import SplitResult, unquote, urlsplit

from .base import StorageBackend
from .file_store import FileStore
from .keys import Namespace
from .redis_nodes import Address
from .redis_store import RedisStore

SCHEMES = ("file", "redis", "redis+cluster")


class StoreLocation(NamedTuple):
    """A parsed location: a directory (``path``) or Redis servers (``seeds``)."""

    scheme: str
    """``file``, ``redis`` or ``redis+cluster``."""
    path: str | None = None
    """The file store's directory (``file`` only)."""
    seeds: tuple[Address, ...] = ()
    """The standalone server, or any nodes of the cluster."""
    password: str | None = None

    @property
    def cluster(self) -> bool:
        return self.scheme == "redis+cluster"


_USER_INFO = re.compile(r"(://)[^\s'\"]*@")  # a URL's user part, to its last '@' (a parser's)


def hide_password(text: str, location: str | None = None) -> str:
    """``text`` with the user information of every URL in it shown as ``***`` (a password
    is never printed: error messages go to terminals and logs). ``location``: the URL the
    text is about; every piece of its password (split where a parser may cut it: at ``:``,
    ``/``, ``?``, ``#``, ``@``) is hidden too, wherever the text quotes it."""
    hidden = _USER_INFO.sub(r"\1***@", text)
    if location is None or "://" not in location or "@" not in location:
        return hidden
    user = location[location.index("://") + 3:location.rindex("@")]
    for piece in sorted(re.split(r"[:/?#@]", user), key=len, reverse=True):
        if len(piece) > 1:
            hidden = hidden.replace(piece, "***")
    return hidden


def open_store(location: str, namespace: Namespace, **options: Any) -> StorageBackend:
    """The backend ``location`` names, for ``namespace``; ``options`` go to its constructor
    (``timeout_s``, ``checksum``; ``capacity_bytes``, ``num_threads``, ``direct_io`` for
    files; ``num_threads``, ``pipeline_pages`` for Redis). Opens no connection yet.

    Raises:
        ValueError: an unknown scheme, a malformed address, a path that is not a directory.
    """
    parsed = parse_location(location)
    if parsed.path is not None:
        return FileStore(parsed.path, namespace, **options)
    return RedisStore(parsed.seeds, namespace, cluster=parsed.cluster,
                      password=parsed.password, **options)


def parse_location(location: str) -> StoreLocation:
    """What ``location`` names (see the module docstring); opens and touches nothing.

    Raises:
        ValueError: an unknown scheme or a malformed address, naming the fix.
    """
    if not isinstance(location, str) or not location:
        raise ValueError(f"storage location must be a path or URL, got {location!r}")
    if "://" not in location:
        return StoreLocation("file", path=location)
    parts = _split(location)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"{location!r}: write file URLs as file:///absolute/path")
        return StoreLocation("file", path=unquote(parts.path))
    if parts.scheme in ("redis", "redis+cluster"):
        _refuse_ignored_parts(location, parts)
        password = unquote(parts.password) if parts.password else None
        hosts = parts.netloc.rsplit("@", 1)[-1]
        seeds = tuple(parse_address(item, location) for item in hosts.split(",") if item)
        if not seeds:
            raise ValueError(f"{location!r}: no host:port after {parts.scheme}://")
        if len(seeds) > 1 and parts.scheme == "redis":
            raise ValueError(f"{location!r}: several hosts need redis+cluster://")
        if parts.path not in ("", "/", "/0"):
            raise ValueError(f"{location!r}: only database 0 is supported (cluster mode has "
                             "no other); drop the path")
        return StoreLocation(parts.scheme, seeds=seeds, password=password)
    raise ValueError(f"{location!r}: unknown storage scheme {parts.scheme!r}; use a directory "
                     f"path or one of {', '.join(s + '://' for s in SCHEMES)}")


def _split(location: str) -> SplitResult:
    """``urlsplit`` with the network location taken as written: a cluster's seeds are several
    ``host:port`` items, IPv6 ones in brackets, which newer Pythons' ``urlsplit`` refuses
    after the first item ("Invalid IPv6 URL"). The path, query and fragment are split by
    ``urlsplit`` as usual."""
    scheme, _, rest = location.partition("://")
    ends = [i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0]
    end = min(ends, default=len(rest))
    tail = urlsplit(f"{scheme}://{rest[end:]}")
    return SplitResult(scheme.lower(), rest[:end], tail.path, tail.query, tail.fragment)


def _refuse_ignored_parts(location: str, parts: SplitResult) -> None:
    """A user name, a query or a fragment, which the store would drop without a word."""
    user = parts.netloc.rsplit("@", 1)[0].partition(":")[0] if "@" in parts.netloc else ""
    if user:
        raise ValueError(f"{location!r}: the user name {unquote(user)!r} is not supported (the "
                         f"store authenticates with a password only); write "
                         f"{parts.scheme}://:password@host:port")
    for name, value, mark in (("query", parts.query, "?"), ("fragment", parts.fragment, "#")):
        if value:
            raise ValueError(f"{location!r}: the {name} {mark}{value} is not supported (the "
                             f"store would ignore it); drop it")


def parse_address(item: str, location: str | None = None) -> Address:
    """``(host, port)`` from ``host:port`` (``[::1]:port`` for IPv6, a zone written ``%25``
    as in a URL: ``[fe80::1%25eth0]:port``); ``ValueError`` naming ``location`` (the string
    ``item`` came from) otherwise: a port not of ASCII digits in 1..65535, brackets that do
    not enclose an IPv6 address, a colon outside them, white space."""
    host, sep, port = item.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and ":" in host
    inner = host[1:-1] if bracketed else host
    if (not sep or not inner or not (port.isascii() and port.isdigit())
            or not 0 < int(port) < 65536 or any(c in inner for c in "[]")
            or (not bracketed and ":" in inner) or any(c.isspace() for c in inner)):
        where = f"{location!r}: " if location is not None else ""
        raise ValueError(f"{where}{item!r} is not host:port (e.g. 127.0.0.1:6379, "
                         f"[::1]:6379)")
    return (inner.replace("%25", "%") if bracketed else inner), int(port)
