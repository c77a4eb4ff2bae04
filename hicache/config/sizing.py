"""Sizes of every pool a config asks for, computed without allocating anything.

Bytes per token per layer per component are ``row_elems * dtype size``: ``row_elems`` is
``num_kv_heads * head_dim`` with two components (K and V) for MHA, ``latent_dim`` with one
for MLA. The ``full`` pools hold the full-attention layers (every layer without SWA), the
``swa`` pools the sliding-window layers.

Every pool allocates its usable pages plus the reserved padding page 0::

    slots = (num_pages + 1) * page_size_tokens
    size_bytes = slots * token_bytes            # token_bytes: all components, all its layers

Host pools get ``host.ratio`` x the device pool's tokens, rounded down to whole pages, or a
share of ``host.size_gib`` proportional to the device pool's bytes (usable tokens x
token_bytes), whose whole allocation, reserved page included, fits in that share. With
``host.swa_history: all`` (hybrid models) the host SWA pool holds as many tokens as the host
full pool, so every host page can keep its SWA rows; ``host.size_gib`` is then split by bytes
per token, which gives both host pools the same token count. The
full-to-SWA slot map of a hybrid device pool (8 bytes per full slot) is not counted.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple

from .choices import SWAHistory
from .parse import ConfigError

if TYPE_CHECKING:  # HiCacheConfig checks its host pools with pool_sizes at construction
    from .hicache import HiCacheConfig

GIB = 2**30

Tier = Literal["device", "host"]
PoolName = Literal["full", "swa"]

# ratio x pages is rounded down; this keeps 0.1 x 160 tokens from landing just under 1 page
_RATIO_SLACK = 1e-9


class PoolSize(NamedTuple):
    """One pool's capacity and allocation.

    ``num_tokens`` and ``num_pages`` are usable capacity (the reserved page excluded);
    ``size_bytes`` is the whole allocation (reserved page included).
    """

    tier: Tier
    pool: PoolName
    num_tokens: int
    num_pages: int
    size_bytes: int


def pool_names(config: HiCacheConfig) -> tuple[PoolName, ...]:
    """``("full", "swa")`` for a hybrid model, ``("full",)`` otherwise."""
    return ("full", "swa") if config.is_hybrid else ("full",)


def pool_layers(config: HiCacheConfig, pool_name: PoolName) -> tuple[int, ...]:
    """Model layer ids stored in ``pool_name`` pools, in their local layer order."""
    _check_pool_name(config, pool_name)
    model = config.model
    return model.swa_layer_ids if pool_name == "swa" else model.full_layer_ids


def token_bytes(config: HiCacheConfig, pool_name: PoolName) -> int:
    """Bytes of one token (all components, all layers) in a ``pool_name`` pool."""
    return config.model.row_geometry.token_bytes(len(pool_layers(config, pool_name)))


def device_num_pages(config: HiCacheConfig, pool_name: PoolName) -> int:
    """Usable pages of the device pool ``pool_name`` (the reserved page excluded)."""
    _check_pool_name(config, pool_name)
    pool = config.device_pool
    num_tokens = pool.swa_num_tokens if pool_name == "swa" else pool.num_tokens
    assert num_tokens is not None, "HiCacheConfig requires swa_num_tokens for hybrid models"
    return num_tokens // config.page_size_tokens


def host_num_pages(config: HiCacheConfig, pool_name: PoolName) -> int:
    """Usable pages of the host pool ``pool_name``: pass it as ``HostKVPool(num_pages=...)``.

    Raises:
        ConfigError: the host share of this pool is smaller than one usable page (naming
            ``host.ratio`` or ``host.size_gib`` and the smallest value that works).
        ValueError: ``pool_name`` is not a pool of this config.
    """
    _check_pool_name(config, pool_name)
    host = config.host
    if pool_name == "swa" and host.swa_history is SWAHistory.ALL:
        return host_num_pages(config, "full")
    device_pages = device_num_pages(config, pool_name)
    if host.ratio is not None:
        num_pages = math.floor(host.ratio * device_pages + _RATIO_SLACK)
        if num_pages < 1:
            raise _too_small(config, pool_name, f"{host.ratio} x {device_pages} device pages "
                             f"is {host.ratio * device_pages:.3g} pages")
        return num_pages
    assert host.size_gib is not None, "HostTierConfig requires ratio or size_gib"
    share_bytes, total_bytes = _share_weight(config, pool_name), sum(
        _share_weight(config, name) for name in pool_names(config)
    )
    budget_bytes = int(host.size_gib * GIB) * share_bytes // total_bytes
    page_bytes = config.page_size_tokens * token_bytes(config, pool_name)
    # the whole allocation, reserved padding page included, stays inside the budget
    num_pages = budget_bytes // page_bytes - 1
    if num_pages < 1:
        raise _too_small(config, pool_name, f"its share is {budget_bytes} bytes but one page "
                         f"plus the reserved page take {2 * page_bytes} bytes")
    return num_pages


def staging_bytes(config: HiCacheConfig) -> int:
    """Device memory the ``staged`` backend may take: two chunks of ``staging_tokens`` tokens
    plus one page of the widest pool, for each of the two side streams (write and load). 0
    when no staged move can run (another backend, or a CPU device where ``auto`` is
    ``torch``)."""
    backend = config.controller.io_backend.value
    on_gpu = config.device_pool.device.startswith("cuda")
    if backend == "staged" or (backend == "auto" and on_gpu):
        widest = max(token_bytes(config, name) for name in pool_names(config))
        chunk_tokens = config.controller.staging_tokens + config.page_size_tokens
        return 2 * 2 * chunk_tokens * widest
    return 0


def pool_sizes(config: HiCacheConfig) -> list[PoolSize]:
    """Every pool of ``config``: device pools first, then host pools; ``full`` before ``swa``.

    Raises:
        ConfigError: a host pool would be smaller than one page.
    """
    names = pool_names(config)
    device = [_size(config, "device", name, device_num_pages(config, name)) for name in names]
    host = [_size(config, "host", name, host_num_pages(config, name)) for name in names]
    return device + host


def _size(config: HiCacheConfig, tier: Tier, pool_name: PoolName, num_pages: int) -> PoolSize:
    page = config.page_size_tokens
    size_bytes = (num_pages + 1) * page * token_bytes(config, pool_name)
    return PoolSize(tier, pool_name, num_pages * page, num_pages, size_bytes)


def _share_weight(config: HiCacheConfig, pool_name: PoolName) -> int:
    """The weight of a host pool's share of ``host.size_gib``: its device pool's usable
    bytes, or its bytes per token when every host token keeps its SWA rows (equal tokens)."""
    if config.is_hybrid and config.host.swa_history is SWAHistory.ALL:
        return token_bytes(config, pool_name)
    num_tokens = device_num_pages(config, pool_name) * config.page_size_tokens
    return num_tokens * token_bytes(config, pool_name)


def _check_pool_name(config: HiCacheConfig, pool_name: str) -> None:
    if pool_name not in pool_names(config):
        raise ValueError(
            f"pool {pool_name!r} is not a pool of this config; its pools are "
            f"{', '.join(pool_names(config))}"
        )


def _least_host(config: HiCacheConfig, pool_name: PoolName) -> float:
    """The smallest ``host.ratio`` (or ``host.size_gib``, whichever the config uses) that
    gives pool ``pool_name`` one usable page."""
    if config.host.ratio is not None:
        return math.ceil(1e4 / device_num_pages(config, pool_name)) / 1e4
    share_bytes = _share_weight(config, pool_name)
    total_bytes = sum(_share_weight(config, name) for name in pool_names(config))
    page_bytes = config.page_size_tokens * token_bytes(config, pool_name)
    return math.ceil(2 * page_bytes * total_bytes / share_bytes / GIB * 1e6) / 1e6


def _too_small(config: HiCacheConfig, pool_name: str, detail: str) -> ConfigError:
    """Pool ``pool_name`` gets no usable page; the fix offered is the least value that gives
    every host pool one (the least of this pool alone could still starve another)."""
    sized = [name for name in pool_names(config)
             if not (name == "swa" and config.host.swa_history is SWAHistory.ALL)]
    least = max(_least_host(config, name) for name in sized)
    key, value = config.host.size_key
    return ConfigError(
        f"{key} = {value!r}: host smaller than one page for pool '{pool_name}' ({detail}, "
        f"page_size_tokens = {config.page_size_tokens}); raise {key} to at least {least}",
        key=key,
    )
