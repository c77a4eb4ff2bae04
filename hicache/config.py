"""Strict configuration: YAML -> frozen dataclasses, one per component, validated on load.

The YAML file has the sections ``model``, ``device_pool``, ``host``, ``controller`` and
``service`` plus the top-level ``page_size_tokens``. Every field carries its unit in its name
and a docstring; closed choices are enums with string values. Loading is strict: an unknown
key, a missing required key, a wrong type (``true`` is not an integer; an integer is a fine
float), a bad choice or an impossible size raises :class:`ConfigError`, whose one-line
message names the dotted key (``host.layout``), the value and the fix.

Validation is pure arithmetic: nothing is allocated. Constructing :class:`HiCacheConfig`
checks every size, down to each host pool holding at least one page (the sizes come from
:mod:`hicache.sizing`); :func:`config_from_dict` and :func:`load_config` then check that the
host pools fit in the RAM available now, minus ``host.ram_reserve_gib``.

This module holds what the config is: the enums, the section dataclasses, loading and the
RAM check. The generic machinery (strict YAML, typed conversion, the check helpers and
:class:`ConfigError` itself, re-exported here) lives in :mod:`hicache.config_parse`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from .config_parse import (
    ConfigError,
    StrictLoader,
    build_section,
    check_min,
    check_positive,
    fail,
    forbid,
    require,
    yaml_reason,
)
from .pools import AttentionKind, HostLayout, RowGeometry

logger = logging.getLogger(__name__)

GIB = 2**30


class DType(enum.Enum):
    """Element type of the KV rows."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32}[self.value]


class IOBackend(enum.Enum):
    """How pages cross PCIe: index ops, the Triton UVA kernel, staged copies, or picked."""

    TORCH = "torch"
    KERNEL = "kernel"
    STAGED = "staged"
    AUTO = "auto"


class WritePolicy(enum.Enum):
    """When device pages are backed up to the host tier."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class EvictionPolicy(enum.Enum):
    """Which cached prefix leaves a full tier first."""

    LRU = "lru"
    LFU = "lfu"


# ---- components ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What one token stores per layer (section ``model``)."""

    num_layers: int
    """Decoder layers of the model (>= 1)."""
    dtype: DType
    """Element type of the KV rows."""
    attention: AttentionKind = AttentionKind.MHA
    """``mha``: K and V rows of ``num_kv_heads * head_dim``; ``mla``: one latent row."""
    num_kv_heads: int | None = None
    """KV heads per layer (MHA only, >= 1)."""
    head_dim: int | None = None
    """Elements per head (MHA only, >= 1)."""
    latent_dim: int | None = None
    """Elements of the latent row (MLA only, >= 1)."""
    swa_layers: tuple[int, ...] = ()
    """Layer ids (0-based) using sliding-window attention; empty: no SWA."""
    window_tokens: int | None = None
    """Sliding window in tokens (required, >= 1, when ``swa_layers`` is not empty)."""

    def __post_init__(self) -> None:
        check_min("model.num_layers", self.num_layers, 1)
        if self.attention is AttentionKind.MHA:
            require("model.num_kv_heads", self.num_kv_heads, 1, "for attention mha")
            require("model.head_dim", self.head_dim, 1, "for attention mha")
            forbid("model.latent_dim", self.latent_dim, "it is for attention mla only")
        else:
            require("model.latent_dim", self.latent_dim, 1, "for attention mla")
            for key, value in (("model.num_kv_heads", self.num_kv_heads),
                               ("model.head_dim", self.head_dim)):
                forbid(key, value, "mla stores one latent row of latent_dim per token")
        self._check_swa()

    def _check_swa(self) -> None:
        for i, layer in enumerate(self.swa_layers):
            if not 0 <= layer < self.num_layers:
                raise fail(f"model.swa_layers[{i}]", layer, "layer id out of range",
                            f"use ids 0..{self.num_layers - 1} (model.num_layers is "
                            f"{self.num_layers})")
            if layer in self.swa_layers[:i]:
                raise fail(f"model.swa_layers[{i}]", layer, "duplicated layer id",
                            "list each sliding-window layer once")
        if self.swa_layers and len(self.swa_layers) == self.num_layers:
            raise fail("model.swa_layers", list(self.swa_layers),
                        "every layer is sliding-window; the full pool needs at least one "
                        "full-attention layer", "leave the full-attention layers out of it")
        if self.swa_layers:
            require("model.window_tokens", self.window_tokens, 1,
                     "when model.swa_layers is not empty")
        else:
            forbid("model.window_tokens", self.window_tokens,
                    "model.swa_layers is empty, so there is no sliding window")

    @property
    def is_hybrid(self) -> bool:
        """True when some layers use sliding-window attention (a full + SWA pool pair)."""
        return bool(self.swa_layers)

    @property
    def swa_layer_ids(self) -> tuple[int, ...]:
        """Sliding-window layer ids in order (the local layer order of the SWA pools)."""
        return tuple(sorted(self.swa_layers))

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """Full-attention layer ids in order (all layers without SWA)."""
        return tuple(i for i in range(self.num_layers) if i not in self.swa_layers)

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype.torch_dtype

    @property
    def row_geometry(self) -> RowGeometry:
        """Row shape and dtype of every pool of this model (unused dims are 0)."""
        return RowGeometry(
            kind=self.attention, num_kv_heads=self.num_kv_heads or 0,
            head_dim=self.head_dim or 0, latent_dim=self.latent_dim or 0,
            dtype=self.torch_dtype,
        )


@dataclass(frozen=True, kw_only=True)
class DevicePoolConfig:
    """GPU (L1) pools (section ``device_pool``)."""

    num_tokens: int
    """Full pool capacity in tokens, a page multiple; the reserved padding page is extra."""
    swa_num_tokens: int | None = None
    """SWA pool capacity in tokens, a page multiple >= model.window_tokens (SWA models only)."""
    device: str = "cpu"
    """Where the pools live: ``cpu``, ``cuda`` or ``cuda:N``."""

    def __post_init__(self) -> None:
        check_min("device_pool.num_tokens", self.num_tokens, 1)
        if self.swa_num_tokens is not None:
            check_min("device_pool.swa_num_tokens", self.swa_num_tokens, 1)
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise fail("device_pool.device", self.device, "not a device",
                        "use cpu, cuda or cuda:N")


@dataclass(frozen=True, kw_only=True)
class HostTierConfig:
    """Pinned host (L2) pools (section ``host``); give exactly one of ``ratio``, ``size_gib``."""

    ratio: float | None = None
    """Host tokens per device token of each pool (> 0), rounded down to whole pages."""
    size_gib: float | None = None
    """GiB for all host pools (> 0), split like the device pools' bytes."""
    layout: HostLayout = HostLayout.LAYER_FIRST
    """``layer_first`` (layer-wise loads) or ``page_first`` (whole pages contiguous)."""
    ram_reserve_gib: float = 2.0
    """GiB of available RAM the host pools must leave free (>= 0)."""

    def __post_init__(self) -> None:
        if self.ratio is not None and self.size_gib is not None:
            raise ConfigError(
                f"host.ratio = {self.ratio!r} and host.size_gib = {self.size_gib!r}: both "
                f"given; keep exactly one of them", key="host.ratio",
            )
        if self.ratio is None and self.size_gib is None:
            raise ConfigError(
                "host: neither host.ratio nor host.size_gib given; add exactly one "
                "(e.g. ratio: 2.0 for twice the device pools' tokens)", key="host.ratio",
            )
        if self.ratio is not None:
            check_positive("host.ratio", self.ratio)
        if self.size_gib is not None:
            check_positive("host.size_gib", self.size_gib)
        check_min("host.ram_reserve_gib", self.ram_reserve_gib, 0)

    @property
    def size_key(self) -> tuple[str, float]:
        """The key that sizes the host tier and its value (for error messages)."""
        if self.ratio is not None:
            return "host.ratio", self.ratio
        assert self.size_gib is not None, "validated in __post_init__"
        return "host.size_gib", self.size_gib


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Data movement and cache policy (section ``controller``)."""

    io_backend: IOBackend = IOBackend.AUTO
    """Transfer backend: torch, kernel, staged, or auto (picked per device, layout, size)."""
    kernel_programs: int = 16
    """Persistent grid size of the transfer kernel, in programs (>= 1)."""
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH_SELECTIVE
    """When to back device pages up to the host."""
    write_through_hits: int = 2
    """Hits before a prefix is backed up under write_through_selective (>= 1)."""
    load_back_threshold_tokens: int = 16
    """Host hits shorter than this many tokens are recomputed, not loaded (>= 0)."""
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    """Eviction order of both tiers."""
    event_ring_size: int = 3
    """Event sets of layer-wise loads in flight at once (>= 2)."""
    staging_tokens: int = 1024
    """Chunk of the staged backend's device staging buffer, in tokens (>= 1)."""

    def __post_init__(self) -> None:
        check_min("controller.kernel_programs", self.kernel_programs, 1)
        check_min("controller.write_through_hits", self.write_through_hits, 1)
        check_min("controller.load_back_threshold_tokens", self.load_back_threshold_tokens, 0)
        check_min("controller.event_ring_size", self.event_ring_size, 2)
        check_min("controller.staging_tokens", self.staging_tokens, 1)


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """The background service (section ``service``)."""

    metrics_enabled: bool = True
    """Serve Prometheus metrics over HTTP."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds."""
    metrics_port: int = 9400
    """TCP port of the metrics endpoint (0..65535; 0 picks a free one)."""
    integrity_check_interval_s: float = 1.0
    """Seconds between integrity checks while idle (>= 0; 0 checks at every idle poll)."""

    def __post_init__(self) -> None:
        if not self.metrics_host:
            raise fail("service.metrics_host", self.metrics_host, "empty address",
                        "use 127.0.0.1 (local only) or an address of this machine")
        check_min("service.metrics_port", self.metrics_port, 0)
        if self.metrics_port > 65535:
            raise fail("service.metrics_port", self.metrics_port, "not a TCP port",
                        "use 0..65535 (0 picks a free port)")
        check_min("service.integrity_check_interval_s", self.integrity_check_interval_s, 0)


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
        from .sizing import pool_sizes  # sizing imports this module

        pool_sizes(self)  # raises when a host pool would be smaller than one page

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


# ---- loading ------------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str], *, check_ram: bool = True) -> HiCacheConfig:
    """Read and validate a YAML config file.

    Args:
        path: the YAML file.
        check_ram: also check that the host pools fit in the RAM available now.
    Raises:
        ConfigError: unreadable file, invalid YAML, or any invalid setting; the message is
            one line starting with ``path``.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{path}: cannot read the config file ({reason})") from None
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML{yaml_reason(exc)}") from None
    try:
        return config_from_dict(data, check_ram=check_ram)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}", key=exc.key) from None


def config_from_dict(data: object, *, check_ram: bool = True) -> HiCacheConfig:
    """Build and validate a config from a parsed YAML mapping (see the module docstring).

    Raises:
        ConfigError: the message names the dotted key, the value and the fix.
    """
    if data is None:
        raise ConfigError("the config is empty; it needs at least the sections model, "
                          "device_pool, host and the key page_size_tokens")
    config: HiCacheConfig = build_section(HiCacheConfig, data, "")
    if check_ram:
        check_host_memory(config)
    return config


def available_ram_bytes() -> int | None:
    """RAM available to new allocations now, in bytes (``MemAvailable``); ``None`` if unknown."""
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/meminfo", encoding="ascii") as meminfo,
    ):
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_host_memory(config: HiCacheConfig) -> None:
    """Raise ``ConfigError`` unless all host pools fit in available RAM minus the reserve."""
    from .sizing import pool_sizes  # sizing imports this module

    need = sum(size.size_bytes for size in pool_sizes(config) if size.tier == "host")
    available = available_ram_bytes()
    if available is None:
        logger.warning("cannot read available RAM; host pools of %.2f GiB are not checked",
                       need / GIB)
        return
    reserve = int(config.host.ram_reserve_gib * GIB)
    budget = available - reserve
    if need <= budget:
        return
    key, value = config.host.size_key
    most = math.floor(value * max(budget, 0) / need * 100) / 100
    raise fail(
        key, value,
        f"host pools need {need / GIB:.2f} GiB but {available / GIB:.2f} GiB of RAM is "
        f"available and host.ram_reserve_gib keeps {reserve / GIB:.2f} GiB of it",
        f"lower {key} to at most {most}, lower host.ram_reserve_gib, or free memory",
    )
