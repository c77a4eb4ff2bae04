"""The shared store (L3): page keys, the page object format and the backends.

- :func:`chain_page_hashes`, :class:`Namespace`: what a page is called and where it belongs;
- :class:`StorageBackend` (:class:`FileStore`, :class:`RedisStore`), :func:`open_store`: the
  interface the controller's worker threads call, and its two implementations;
- :func:`parse_location`: the location strings ``open_store`` and the config accept;
  :func:`probe_store`: whether the store at one can be used from here now;
- :func:`host_page_views`: a host pool's pages as the byte segments the backends read and write.
"""

from __future__ import annotations

from .base import (
    DEFAULT_TIMEOUT_S,
    PageBuffers,
    PageStatus,
    StorageBackend,
    StorageResult,
    StorageStats,
    StorageUnavailable,
)
from .file_store import FileStore
from .host_views import byte_view, host_page_views
from .keys import PAGE_HASH_BYTES, Namespace, chain_page_hashes
from .page_format import PageFormat
from .probe import StoreProbe, describe_location, probe_store
from .redis_store import RedisStore
from .store_url import StoreLocation, hide_password, open_store, parse_address, parse_location

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PAGE_HASH_BYTES",
    "FileStore",
    "Namespace",
    "PageBuffers",
    "PageFormat",
    "PageStatus",
    "RedisStore",
    "StorageBackend",
    "StorageResult",
    "StorageStats",
    "StorageUnavailable",
    "StoreLocation",
    "StoreProbe",
    "byte_view",
    "chain_page_hashes",
    "describe_location",
    "hide_password",
    "host_page_views",
    "open_store",
    "parse_address",
    "parse_location",
    "probe_store",
]
