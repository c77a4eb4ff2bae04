"""The whole configuration: the sections together, and the checks that span them.

Constructing :class:`HiCacheConfig` checks every size, down to each host pool holding at
least one page (the sizes come from :mod:`hicache.config.sizing`). Loading a file, and the
check that the pools in RAM fit in the RAM available now, live in :mod:`hicache.config.loading`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .parse import ConfigError, check_min, fail, forbid
from .sections import (
    ControllerConfig,
    DevicePoolConfig,
    HostTierConfig,
    ModelConfig,
    ServiceConfig,
)
from .sizing import GIB, pool_names, pool_sizes, token_bytes
from .storage import StorageConfig


@dataclass(frozen=True, kw_only=True)
class HiCacheConfig:
    """The whole configuration; cross-component sizes are checked here."""

    model: ModelConfig
    device_pool: DevicePoolConfig
    page_size_tokens: int
    """Tokens per page (>= 1): the unit of allocation, matching and transfer."""
    host: HostTierConfig
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        check_min("page_size_tokens", self.page_size_tokens, 1)
        pool = self.device_pool
        self._check_pages("device_pool.num_tokens", pool.num_tokens)
        if not self.is_hybrid:
            forbid("device_pool.swa_num_tokens", pool.swa_num_tokens,
                    "model.swa_layers is empty, so there is no SWA pool")
        else:
            self._check_swa_pool()
        self._check_host_pages()
        self._check_storage_cap()

    def _check_swa_pool(self) -> None:
        pool = self.device_pool
        window = self.model.window_tokens
        assert window is not None, "ModelConfig requires window_tokens with swa_layers"
        min_swa = -(-window // self.page_size_tokens) * self.page_size_tokens
        if window > pool.num_tokens:
            raise fail("model.window_tokens", window, "window larger than the device pool",
                        f"raise device_pool.num_tokens ({pool.num_tokens}) to at least "
                        f"{min_swa} or shrink the window")
        if pool.swa_num_tokens is None:
            raise ConfigError(
                f"device_pool.swa_num_tokens: missing; the model has sliding-window layers "
                f"{list(self.model.swa_layers)}, so add it (at least {min_swa} tokens)",
                key="device_pool.swa_num_tokens",
            )
        self._check_pages("device_pool.swa_num_tokens", pool.swa_num_tokens)
        if pool.swa_num_tokens < window:
            raise fail("device_pool.swa_num_tokens", pool.swa_num_tokens,
                        f"SWA pool smaller than the window (model.window_tokens = {window})",
                        f"set it to at least {min_swa}")
        if pool.swa_num_tokens > pool.num_tokens:
            raise fail("device_pool.swa_num_tokens", pool.swa_num_tokens,
                        f"larger than device_pool.num_tokens ({pool.num_tokens}); every SWA "
                        f"slot belongs to a full slot, so the rest would never be used",
                        f"set it to at most {pool.num_tokens}")

    def _check_host_pages(self) -> None:
        pool_sizes(self)  # raises when a host pool would be smaller than one page

    def _check_storage_cap(self) -> None:
        cap = self.storage.capacity_bytes
        page_bytes = self.page_size_tokens * sum(token_bytes(self, name)
                                                 for name in pool_names(self))
        if cap is not None and cap < page_bytes:
            least = math.ceil(page_bytes / GIB * 1e6) / 1e6
            raise fail("storage.size_cap_gib", self.storage.size_cap_gib,
                        f"smaller than one page ({page_bytes} bytes)",
                        f"raise it to at least {least}")

    def _check_pages(self, key: str, num_tokens: int) -> None:
        page = self.page_size_tokens
        if num_tokens % page:
            low = num_tokens // page * page
            options = f"{low} or {low + page}" if low else f"{page}"
            raise fail(key, num_tokens,
                        f"not a multiple of page_size_tokens ({page})", f"use {options}")

    @property
    def is_hybrid(self) -> bool:
        """True when the model has sliding-window layers (full + SWA pools)."""
        return self.model.is_hybrid

