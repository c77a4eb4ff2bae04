"""Objects a backend derives once per pair of host and device pools and reuses for every op
between them (the ``direct`` backend's run plans, the ``staged`` backend's pool views),
kept in weak mappings keyed by both pools: an entry goes when either pool does, so an
object kept here must hold neither pool, only what it needs of them."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from hicache.pools import DeviceKVPool, HostKVPool

Derived = TypeVar("Derived")


class PoolPairCache(Generic[Derived]):
    """``make(host_pool, device_pool)``, made once per pair (:meth:`get`)."""

    def __init__(self, make: Callable[[HostKVPool, DeviceKVPool], Derived]) -> None:
        self._make = make
        self._by_host: weakref.WeakKeyDictionary[
            HostKVPool, weakref.WeakKeyDictionary[DeviceKVPool, Derived]] = (
            weakref.WeakKeyDictionary())

    def get(self, host_pool: HostKVPool, device_pool: DeviceKVPool) -> Derived:
        """The object of this pool pair, made on first use."""
        by_device = self._by_host.get(host_pool)
        if by_device is None:
            by_device = self._by_host[host_pool] = weakref.WeakKeyDictionary()
        found = by_device.get(device_pool)
        if found is None:
            found = by_device[device_pool] = self._make(host_pool, device_pool)
        return found

    def __len__(self) -> int:
        """Host pools that have an entry (alive)."""
        return len(self._by_host)
