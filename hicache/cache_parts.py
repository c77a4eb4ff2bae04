"""The parts of a service that a config sizes: backend, device pool(s), host pool(s), the
controller between them (registered as the device pool's layer waiter, so every attention
accessor waits for layer-wise loads by construction) and the radix tree over them.

:func:`build_cache_parts` is one step for ``build_service``: a rank of a tensor-parallel
group whose step fails (too little RAM for its pools, a GPU out of memory, a backend not
usable here) fails it on every rank at once, and the ranks that made theirs close them
(:meth:`CacheParts.close`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from hicache.controller import (
    CacheController,
    HybridCacheController,
    TransferBackend,
    TransferCore,
    make_backend,
)
from hicache.pools import DeviceKVPool, HostKVPool, HybridSWAPool, IndexSpace, PageAllocator

from .config import GIB, HiCacheConfig, SWAHistory, check_machine_memory
from .config.sizing import PoolName, device_num_pages, host_num_pages, pool_layers, pool_sizes
from .radix import HiRadixCache

logger = logging.getLogger(__name__)

_Built = tuple[DeviceKVPool | HybridSWAPool, TransferCore, list[HostKVPool]]


class CacheParts(NamedTuple):
    """What :func:`build_cache_parts` made."""

    device_pool: DeviceKVPool | HybridSWAPool
    controller: TransferCore
    host_pools: list[HostKVPool]
    tree: HiRadixCache

    def close(self) -> None:
        """Release the pinned host memory (the parts of a build that failed elsewhere)."""
        for pool in self.host_pools:
            pool.close()


def build_cache_parts(config: HiCacheConfig) -> CacheParts:
    """Backend, pools, controller and tree for ``config``. Raises ``ConfigError`` for pools
    in RAM larger than this machine's (checked before anything is allocated: not a
    ``MemoryError`` part-way), ``ValueError`` for a backend not usable here."""
    check_machine_memory(config)
    device = torch.device(config.device_pool.device)
    ctl = config.controller
    backend = make_backend(ctl.io_backend.value, device, ctl.kernel_programs,
                           staging_tokens=ctl.staging_tokens)
    for size in pool_sizes(config):
        logger.info("%s pool '%s': %d tokens, %.3f GiB", size.tier, size.pool, size.num_tokens,
                    size.size_bytes / GIB)
    device_pool, controller, host_pools = (
        _build_hybrid(config, device, backend) if config.is_hybrid
        else _build_plain(config, device, backend)
    )
    tree = HiRadixCache(
        controller, write_policy=ctl.write_policy, write_through_hits=ctl.write_through_hits,
        load_back_threshold_tokens=ctl.load_back_threshold_tokens,
        eviction_policy=ctl.eviction_policy,
        window_tokens=config.model.window_tokens if config.is_hybrid else None,
        keep_swa_history=config.host.swa_history is SWAHistory.ALL,
    )
    return CacheParts(device_pool, controller, host_pools, tree)


def _build_plain(config: HiCacheConfig, device: torch.device, backend: TransferBackend) -> _Built:
    page = config.page_size_tokens
    allocator = PageAllocator(device_num_pages(config, "full"), page, IndexSpace.DEVICE_FULL,
                              "full")
    device_pool = DeviceKVPool(
        name="full", space=IndexSpace.DEVICE_FULL, num_layers=config.model.num_layers,
        num_slots=allocator.num_slots, geometry=config.model.row_geometry, device=device,
        page_size=page,
    )
    host = _host_pool(config, "full", IndexSpace.HOST_FULL)
    try:
        controller = CacheController(
            device_pool=device_pool, device_allocator=allocator, host_pool=host,
            backend=backend, event_ring_size=config.controller.event_ring_size,
        )
    except BaseException:
        host.close()
        raise
    device_pool.register_layer_waiter(controller.wait_until)
    return device_pool, controller, [host]


def _build_hybrid(config: HiCacheConfig, device: torch.device, backend: TransferBackend
                  ) -> _Built:
    model = config.model
    hybrid_pool = HybridSWAPool(
        num_layers=model.num_layers, swa_layers=model.swa_layer_ids,
        full_pages=device_num_pages(config, "full"), swa_pages=device_num_pages(config, "swa"),
        page_size=config.page_size_tokens, geometry=model.row_geometry, device=device,
    )
    hosts: list[HostKVPool] = []
    try:
        hosts.append(_host_pool(config, "full", IndexSpace.HOST_FULL))
        hosts.append(_host_pool(config, "swa", IndexSpace.HOST_SWA))
        controller = HybridCacheController(
            hybrid_pool=hybrid_pool, host_full=hosts[0], host_swa=hosts[1], backend=backend,
            event_ring_size=config.controller.event_ring_size,
        )
    except BaseException:
        for host in hosts:
            host.close()
        raise
    hybrid_pool.register_layer_waiter(controller.wait_until)
    return hybrid_pool, controller, hosts


def _host_pool(config: HiCacheConfig, name: PoolName, space: IndexSpace) -> HostKVPool:
    return HostKVPool(
        name=name, space=space, num_layers=len(pool_layers(config, name)),
        num_pages=host_num_pages(config, name), page_size=config.page_size_tokens,
        geometry=config.model.row_geometry, layout=config.host.layout,
    )
