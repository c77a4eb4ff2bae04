"""hicache: a hierarchical KV cache (GPU, pinned host) for an LLM inference engine.

What an engine imports, in one line::

    from hicache import IndexSpace, Indices, build_service, load_config

The names below load their module on first use, so ``import hicache`` (and every
``python -m hicache...`` command) stays cheap: torch, Triton and the Prometheus client
are imported only by the modules that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)

if TYPE_CHECKING:
    from hicache.config import (
        ConfigError,
        HiCacheConfig,
        config_from_dict,
        load_config,
        load_default_config,
    )
    from hicache.factory import build_service
    from hicache.l3 import Prefetch
    from hicache.pools import BoundsError, ForwardLocs, IndexSpace, Indices, PageTable
    from hicache.radix import LoadBack, MatchResult, Refusal, TokenKey, TreeNode
    from hicache.rank_agreement import RanksDivergedError
    from hicache.service import HiCacheService, ServiceError

# The module that defines each public name (the imports above, for type checkers).
_SOURCES: dict[str, str] = {
    "ConfigError": "hicache.config",
    "HiCacheConfig": "hicache.config",
    "config_from_dict": "hicache.config",
    "load_config": "hicache.config",
    "load_default_config": "hicache.config",
    "build_service": "hicache.factory",
    "Prefetch": "hicache.l3",
    "BoundsError": "hicache.pools",
    "ForwardLocs": "hicache.pools",
    "IndexSpace": "hicache.pools",
    "Indices": "hicache.pools",
    "PageTable": "hicache.pools",
    "LoadBack": "hicache.radix",
    "MatchResult": "hicache.radix",
    "Refusal": "hicache.radix",
    "TokenKey": "hicache.radix",
    "TreeNode": "hicache.radix",
    "RanksDivergedError": "hicache.rank_agreement",
    "HiCacheService": "hicache.service",
    "ServiceError": "hicache.service",
}

__all__ = [
    "BoundsError",
    "ConfigError",
    "ForwardLocs",
    "HiCacheConfig",
    "HiCacheService",
    "IndexSpace",
    "Indices",
    "LoadBack",
    "MatchResult",
    "PageTable",
    "Prefetch",
    "RanksDivergedError",
    "Refusal",
    "ServiceError",
    "TokenKey",
    "TreeNode",
    "build_service",
    "config_from_dict",
    "load_config",
    "load_default_config",
]


def __getattr__(name: str) -> object:
    """Import the module of the public ``name`` on first access (PEP 562)."""
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # later lookups find it without calling this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
