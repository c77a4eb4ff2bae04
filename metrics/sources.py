"""The plain objects the exporter reads: small Protocols the core's counters already satisfy.

- :class:`TransferSource`: the controller's ``TransferStats`` (``controller.stats``).
- :class:`CacheSource`: the radix tree's ``CacheStats`` (``tree.stats``).
- :class:`ServiceSource`: the service's own counters (background errors).
- :data:`StorageTierFn`: returns the service's shared-store tier (:class:`StorageTierSource`,
  ``service.storage``), or ``None`` when it has none or no longer has one.
- :data:`PoolUsageFn`: a callable returning one :class:`PoolUsage` row per pool;
  :func:`controller_pool_usage` builds it from a controller's allocators.

Every member is read-only here: the exporter never changes a source, except that it drains
``TransferSource.drain_durations()`` into its histogram.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from hicache.storage.base import StorageStats


class TransferSource(Protocol):
    """Cumulative transfer counts (``hicache.controller.TransferStats``).

    Keys: ``direction`` is a ``Direction`` value, ``pool`` a pool name, ``backend`` the name
    of the backend that executed an op.
    """

    @property
    def ops_submitted(self) -> Mapping[str, int]:
        """Ops submitted per direction."""

    @property
    def ops_acknowledged(self) -> Mapping[str, int]:
        """Ops acknowledged per direction."""

    @property
    def tokens(self) -> Mapping[tuple[str, str], int]:
        """Tokens moved per ``(direction, pool)``."""

    @property
    def bytes(self) -> Mapping[tuple[str, str], int]:
        """Bytes moved per ``(direction, pool)``."""

    @property
    def backend_ops(self) -> Mapping[tuple[str, str], int]:
        """Ops submitted per ``(direction, backend)``."""

    def drain_durations(self) -> Sequence[tuple[str, float]]:
        """Return and forget ``(direction, seconds)`` of acknowledged, event-timed ops."""


class CacheSource(Protocol):
    """Cumulative radix-tree counters in tokens (``hicache.radix.CacheStats``)."""

    @property
    def matched_tokens(self) -> int:
        """Tokens looked up by ``match_prefix`` (whole pages)."""

    @property
    def device_hit_tokens(self) -> int: ...

    @property
    def host_hit_tokens(self) -> int: ...

    @property
    def inserted_tokens(self) -> int: ...

    @property
    def duplicate_tokens(self) -> int: ...

    @property
    def evicted_device_tokens(self) -> int: ...

    @property
    def evicted_host_tokens(self) -> int: ...

    @property
    def loaded_back_tokens(self) -> int: ...

    @property
    def backed_up_tokens(self) -> int: ...

    @property
    def dropped_tokens(self) -> Mapping[str, int]:
        """Tokens dropped per reason."""

    @property
    def refused_load_backs(self) -> Mapping[str, int]:
        """Tokens of refused load-backs per reason."""

    @property
    def refused_backups(self) -> Mapping[str, int]:
        """Tokens of refused backups per reason."""


class ServiceSource(Protocol):
    """The service's own counters."""

    @property
    def background_errors(self) -> int:
        """Exceptions raised in the background thread so far."""

    @property
    def rank_agreements(self) -> int:
        """Steps agreed with the other tensor-parallel ranks (0 without a group)."""

    @property
    def rank_held_ops(self) -> Mapping[str, int]:
        """What a tensor-parallel rank held after its last step, by kind."""


class StorageTierCounters(Protocol):
    """The tier's cumulative counters (``hicache.l3.StorageTierStats``)."""

    @property
    def prefetches(self) -> int: ...

    @property
    def queried_tokens(self) -> int: ...

    @property
    def found_tokens(self) -> int: ...

    @property
    def prefetch_tokens(self) -> Mapping[str, int]:
        """Tokens per prefetch outcome."""

    @property
    def backup_pages(self) -> Mapping[str, int]:
        """Pages per backup outcome."""

    @property
    def backup_evictions(self) -> int: ...

    @property
    def worker_errors(self) -> int: ...


class StoreSource(Protocol):
    """The store's own counters (``hicache.storage.StorageBackend``)."""

    def stats(self) -> StorageStats: ...


class StorageTierSource(Protocol):
    """What the exporter reads of the shared-store tier (``hicache.l3.StorageTier``), under
    the service lock (the scheduler thread writes the counters under it)."""

    @property
    def stats(self) -> StorageTierCounters: ...

    @property
    def store(self) -> StoreSource: ...

    @property
    def queue_depths(self) -> Mapping[str, int]:
        """Jobs waiting per queue (``prefetch``, ``backup``)."""

    @property
    def write_share_ranks(self) -> int:
        """Ranks that split the writes of one copy (0: this rank writes every page)."""


# Called on every scrape, under the source lock: the tier may come and go (``None`` after
# the service stops).
StorageTierFn = Callable[[], StorageTierSource | None]


class PoolUsage(NamedTuple):
    """Occupancy of one pool: ``tier`` is ``device`` or ``host``, ``pool`` ``full`` or ``swa``."""

    tier: str
    pool: str
    used_tokens: int
    total_tokens: int


# Returns the current rows; called on every scrape, from the HTTP server's thread.
PoolUsageFn = Callable[[], Iterable[tuple[str, str, int, int]]]


class TokenAllocator(Protocol):
    """What pool occupancy needs of an allocator (``hicache.pools.PageAllocator``)."""

    @property
    def name(self) -> str: ...

    @property
    def num_used_tokens(self) -> int: ...

    @property
    def capacity_tokens(self) -> int: ...


class _HasAllocator(Protocol):
    @property
    def allocator(self) -> TokenAllocator: ...


class ControllerPools(Protocol):
    """What :func:`controller_pool_usage` reads of a ``CacheController``."""

    @property
    def device_allocator(self) -> TokenAllocator: ...

    @property
    def host_pool(self) -> _HasAllocator: ...


class _HasSwaAllocator(Protocol):
    @property
    def swa_allocator(self) -> TokenAllocator: ...


@runtime_checkable
class HybridControllerPools(ControllerPools, Protocol):
    """What it also reads of a ``HybridCacheController``."""

    @property
    def hybrid_pool(self) -> _HasSwaAllocator: ...

    @property
    def host_swa(self) -> _HasAllocator: ...


def allocator_usage(allocators: Sequence[tuple[str, TokenAllocator]]) -> PoolUsageFn:
    """A :data:`PoolUsageFn` over ``(tier, allocator)`` pairs; pools are named after the
    allocators. It reads two integers per allocator, so it needs no lock."""
    pairs = tuple(allocators)

    def usage() -> list[PoolUsage]:
        return [PoolUsage(tier, alloc.name, alloc.num_used_tokens, alloc.capacity_tokens)
                for tier, alloc in pairs]

    return usage


def controller_pool_usage(controller: ControllerPools) -> PoolUsageFn:
    """Occupancy of every pool a cache controller moves between: device and host ``full``,
    plus device and host ``swa`` for a hybrid controller."""
    pairs: list[tuple[str, TokenAllocator]] = [
        ("device", controller.device_allocator), ("host", controller.host_pool.allocator),
    ]
    if isinstance(controller, HybridControllerPools):
        pairs += [("device", controller.hybrid_pool.swa_allocator),
                  ("host", controller.host_swa.allocator)]
    return allocator_usage(pairs)
