"""Strict configuration: YAML -> frozen dataclasses, one per component, validated on load.

- :mod:`~hicache.config.choices`: the closed choices (enums);
- :mod:`~hicache.config.sections`: one dataclass per section
  (``model``, ``device_pool``, ``host``, ``controller``, ``service``);
- :mod:`~hicache.config.storage`: the ``storage`` section (the shared store, L3);
- :mod:`~hicache.config.hicache`: :class:`HiCacheConfig`, the sections together and the
  checks that span them;
- :mod:`~hicache.config.loading`: :func:`load_config`, :func:`load_default_config` (the
  ``default.yaml`` shipped in this package), :func:`config_from_dict` and the check of the
  host pools against available RAM;
- :mod:`~hicache.config.sizing`: the size of every pool a config asks for, allocating
  nothing;
- :mod:`~hicache.config.parse`: the generic machinery (strict YAML, typed conversion, the
  check helpers and :class:`ConfigError`).
"""

from __future__ import annotations

from .choices import DType, EvictionPolicy, IOBackend, SWAHistory, WritePolicy
from .hicache import HiCacheConfig
from .loading import (
    DEFAULT_CONFIG_NAME,
    available_ram_bytes,
    check_host_memory,
    check_machine_memory,
    config_from_dict,
    config_from_yaml,
    default_config_text,
    load_config,
    load_default_config,
)
from .parse import ConfigError
from .sections import (
    ControllerConfig,
    DevicePoolConfig,
    HostTierConfig,
    ModelConfig,
    ServiceConfig,
)
from .sizing import (
    GIB,
    PoolName,
    PoolSize,
    device_num_pages,
    host_num_pages,
    pool_layers,
    pool_sizes,
    staging_bytes,
)
from .storage import PrefetchPolicy, StorageConfig, StorageKind

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "GIB",
    "ConfigError",
    "ControllerConfig",
    "DType",
    "DevicePoolConfig",
    "EvictionPolicy",
    "HiCacheConfig",
    "HostTierConfig",
    "IOBackend",
    "ModelConfig",
    "PoolName",
    "PoolSize",
    "PrefetchPolicy",
    "SWAHistory",
    "ServiceConfig",
    "StorageConfig",
    "StorageKind",
    "WritePolicy",
    "available_ram_bytes",
    "check_host_memory",
    "check_machine_memory",
    "config_from_dict",
    "config_from_yaml",
    "default_config_text",
    "device_num_pages",
    "host_num_pages",
    "load_config",
    "load_default_config",
    "pool_layers",
    "pool_sizes",
    "staging_bytes",
]
