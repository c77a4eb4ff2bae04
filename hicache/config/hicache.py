"""The whole configuration: the sections together, and the checks that span them.

Constructing :class:`HiCacheConfig` checks every size, down to each host pool holding at
least one page (the sizes come from :mod:`hicache.config.sizing`). Loading a file, and the
check that the pools in RAM fit in the RAM available now, live in :mod:`hicache.config.loading`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hicache.storage.page_files import DIRECT_ALIGN as FILE_HEADER_BYTES

from .choices import IOBackend, SWAHistory
from .parse import ConfigError, check_min, check_types, fail, forbid
from .sections import (
    ControllerConfig,
    DevicePoolConfig,
    HostTierConfig,
    ModelConfig,
    ServiceConfig,
)
from .sizing import GIB, pool_names, pool_sizes, token_bytes
from .storage import StorageConfig

CUDA_ONLY_BACKENDS = {
    IOBackend.KERNEL: "the Triton kernel copies between CUDA pools and pinned host memory",
    IOBackend.STAGED: "staged copies go through CUDA staging buffers on side streams",
    IOBackend.DIRECT: "direct copies runs of rows with the GPU's copy engine",
}
"""The backends that need CUDA pools, and why (``make_backend`` refuses them on a CPU)."""


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
        check_types(self, "")  # a section made in Python: its types too
        check_min("page_size_tokens", self.page_size_tokens, 1)
        pool = self.device_pool
        self._check_pages("device_pool.num_tokens", pool.num_tokens)
        if not self.is_hybrid:
            forbid("device_pool.swa_num_tokens", pool.swa_num_tokens,
                    "model.swa_layers is empty, so there is no SWA pool")
        else:
            self._check_swa_pool()
        self._check_backend_device()
        self._check_host_pages()
        self._check_storage_cap()

    def _check_backend_device(self) -> None:
        """The CUDA-only backends with CPU pools (``build_service`` would refuse them)."""
        backend = self.controller.io_backend
        if backend in CUDA_ONLY_BACKENDS and self.device_pool.device == "cpu":
            raise fail("controller.io_backend", backend.value,
                        f"{CUDA_ONLY_BACKENDS[backend]}, but device_pool.device is cpu",
                        "choose io_backend: torch or auto for CPU pools, or set "
                        "device_pool.device: cuda")


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
        """A host pool of less than one page (``pool_sizes`` raises), or any pool of 2**63
        bytes or more (no byte count holds it: a typo), naming the key that sizes it."""
        for size in pool_sizes(self):
            if size.size_bytes >= 2**63:
                key, value = (self.host.size_key if size.tier == "host" else
                              (f"device_pool.{'swa_' if size.pool == 'swa' else ''}num_tokens",
                               size.num_tokens))
                raise fail(key, value, f"its {size.tier} pool '{size.pool}' would take "
                           f"{size.size_bytes} bytes, more than 2**63", "give a real size")

    def _check_storage_cap(self) -> None:
        cap = self.storage.capacity_bytes
        # a page's file: its rows and a header padded to 4 KiB (the store reads the rows
        # with O_DIRECT), for the one or two segments a page has
        rows = self.page_size_tokens * sum(token_bytes(self, name) for name in pool_names(self))
        page_bytes = FILE_HEADER_BYTES + rows
        if cap is not None and cap < page_bytes:
            least = math.ceil(page_bytes / GIB * 1e6) / 1e6
            raise fail("storage.size_cap_gib", self.storage.size_cap_gib,
                        f"smaller than one page's file ({page_bytes} bytes: {rows} of rows, "
                        f"a header of {FILE_HEADER_BYTES})", f"raise it to at least {least}")

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


def check_store_swa_history(config: HiCacheConfig) -> None:
    """Refuse a store with a hybrid model whose host keeps SWA rows for windows only (its
    pages go to the store with every SWA row; ``build_service`` refuses it too). Checked on
    loading, not on construction, so that ``dataclasses.replace`` can still make the
    variants a report compares (``hicache check-config`` prices each ``swa_history``)."""
    history = config.host.swa_history
    storage = config.storage
    if storage.is_enabled and config.is_hybrid and history is not SWAHistory.ALL:
        raise fail("host.swa_history", history.value,
                   f"a hybrid model's pages go to the shared store (storage.backend is "
                   f"{storage.backend.value}) with their SWA rows, which window_tails keeps "
                   f"for windows only", "set host.swa_history: all, or storage.backend: none")
