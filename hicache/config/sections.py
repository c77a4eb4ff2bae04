"""The sections of the configuration: one frozen dataclass per component.

The YAML file has the sections ``model``, ``device_pool``, ``host``, ``controller`` and
``service`` plus the top-level ``page_size_tokens``, and ``storage``
(:mod:`hicache.config.storage`). Every field carries its unit in its name and a docstring;
closed choices are the enums of :mod:`hicache.config.choices`. Each section checks its own
fields on construction and raises :class:`~hicache.config.parse.ConfigError`, whose one-line
message names the dotted key (``host.layout``), the value and the fix. Checks that span
sections live in :class:`~hicache.config.hicache.HiCacheConfig`.

Validation is pure arithmetic: nothing is allocated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hicache.pools import AttentionKind, HostLayout, RowGeometry

from .choices import DType, EvictionPolicy, IOBackend, SWAHistory, WritePolicy
from .parse import (
    ConfigError,
    case_hint,
    check_gib,
    check_max,
    check_min,
    check_positive,
    check_seconds,
    check_types,
    fail,
    forbid,
    require,
)

MAX_LAYERS = 4096
"""The most ``model.num_layers`` may be. The deepest models have a few hundred layers; a
larger count is a typo, and the pools, per-layer events and layer lists grow with it (10**12
layers would exhaust memory while the config is checked), so it is refused first."""

MAX_EVENT_RING = 64
"""The most ``controller.event_ring_size`` may be: each set holds an event per layer, and
layer-wise loads overlap a forward a few at a time, so a deeper ring only takes memory."""

MAX_HOST_RATIO = float(2**63)
"""The most ``host.ratio`` may be: host tokens per device token, counted in int64 slots."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What one token stores per layer (section ``model``)."""

    num_layers: int
    """Decoder layers of the model (1..4096)."""
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
        check_types(self, "model")  # a section made in Python: its types too
        check_min("model.num_layers", self.num_layers, 1)
        # before anything that walks the layers (full_layer_ids builds a tuple of them)
        check_max("model.num_layers", self.num_layers, MAX_LAYERS,
                  "no model has more layers; a larger count is a typo")
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
        seen: set[int] = set()
        for i, layer in enumerate(self.swa_layers):
            if not 0 <= layer < self.num_layers:
                raise fail(f"model.swa_layers[{i}]", layer, "layer id out of range",
                            f"use ids 0..{self.num_layers - 1} (model.num_layers is "
                            f"{self.num_layers})")
            if layer in seen:
                raise fail(f"model.swa_layers[{i}]", layer, "duplicated layer id",
                            "list each sliding-window layer once")
            seen.add(layer)
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


_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


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
        check_types(self, "device_pool")  # a section made in Python: its types too
        check_min("device_pool.num_tokens", self.num_tokens, 1)
        if self.swa_num_tokens is not None:
            check_min("device_pool.swa_num_tokens", self.swa_num_tokens, 1)
        if not _DEVICE.fullmatch(self.device):
            meant = self.device.lower()
            hint = case_hint(self.device, [meant]) if _DEVICE.fullmatch(meant) else ""
            raise fail("device_pool.device", self.device, "not a device",
                        f"{hint}use cpu, cuda or cuda:N")


@dataclass(frozen=True, kw_only=True)
class HostTierConfig:
    """Pinned host (L2) pools (section ``host``); give exactly one of ``ratio``, ``size_gib``."""

    ratio: float | None = None
    """Host tokens per device token of each pool (> 0), rounded down to whole pages."""
    size_gib: float | None = None
    """GiB for all host pools (> 0), split like the device pools' bytes."""
    layout: HostLayout = HostLayout.LAYER_FIRST
    """``layer_first`` (layer-wise loads), ``page_first`` (whole pages contiguous) or
    ``page_first_direct`` (whole pages contiguous, each layer of a page ``page_size``
    consecutive rows; with 1-token pages the same bytes as ``page_first``)."""
    ram_reserve_gib: float = 2.0
    """GiB of available RAM the host pools must leave free (>= 0)."""
    swa_history: SWAHistory = SWAHistory.ALL
    """Hybrid models: ``all`` (the SWA rows of every cached page) or ``window_tails`` (only
    each sequence's window tail); ``hicache check-config`` prints what each costs."""

    def __post_init__(self) -> None:
        check_types(self, "host")  # a section made in Python: its types too
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
            if self.ratio > MAX_HOST_RATIO:
                raise fail("host.ratio", self.ratio, "more host tokens per device token "
                            "than a slot index can count (2**63)", "use host tokens per "
                            "device token, e.g. 4.0, or host.size_gib for a size in GiB")
        if self.size_gib is not None:
            check_positive("host.size_gib", self.size_gib)
            check_gib("host.size_gib", self.size_gib)
        check_min("host.ram_reserve_gib", self.ram_reserve_gib, 0)
        check_gib("host.ram_reserve_gib", self.ram_reserve_gib)

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
    """Transfer backend: torch, kernel, staged, direct, or auto (picked per op)."""
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
    """Event sets of layer-wise loads in flight at once (2..64)."""
    staging_tokens: int = 1024
    """Chunk budget of the staged backend's device staging buffers, in tokens of every
    layer (>= 1); each buffer holds one page more, for chunks balanced in whole pages."""

    def __post_init__(self) -> None:
        check_types(self, "controller")  # a section made in Python: its types too
        check_min("controller.kernel_programs", self.kernel_programs, 1)
        check_min("controller.write_through_hits", self.write_through_hits, 1)
        check_min("controller.load_back_threshold_tokens", self.load_back_threshold_tokens, 0)
        check_min("controller.event_ring_size", self.event_ring_size, 2)
        check_max("controller.event_ring_size", self.event_ring_size, MAX_EVENT_RING,
                  "event sets of layer-wise loads in flight at once, each an event per layer")
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
        check_types(self, "service")  # a section made in Python: its types too
        if not self.metrics_host.strip():  # blank: no address either
            raise fail("service.metrics_host", self.metrics_host, "empty address",
                        "use 127.0.0.1 (local only) or an address of this machine")
        check_min("service.metrics_port", self.metrics_port, 0)
        if self.metrics_port > 65535:
            raise fail("service.metrics_port", self.metrics_port, "not a TCP port",
                        "use 0..65535 (0 picks a free port)")
        check_min("service.integrity_check_interval_s", self.integrity_check_interval_s, 0)
        check_seconds("service.integrity_check_interval_s", self.integrity_check_interval_s)

