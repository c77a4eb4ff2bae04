"""Data movement: transfer ops, streams and events, transfer backends, the cache controller
and the hybrid (full + SWA) controller. Bookkeeping of what lives where is the caller's
(``hicache.HiRadixCache``); this package only moves rows and reports completion."""

from .backends import BackendName, KernelBackend, TorchBackend, make_backend
from .base import (
    Ack,
    Direction,
    HybridSlots,
    MovedTransfer,
    PoolTransfer,
    TransferBackend,
    TransferOp,
)
from .controller import CacheController
from .core import TransferCore
from .events import Event, LayerEventRing
from .hybrid import HybridCacheController
from .stats import TransferStats

__all__ = [
    "Ack",
    "BackendName",
    "CacheController",
    "Direction",
    "Event",
    "HybridCacheController",
    "HybridSlots",
    "KernelBackend",
    "LayerEventRing",
    "MovedTransfer",
    "PoolTransfer",
    "TorchBackend",
    "TransferBackend",
    "TransferCore",
    "TransferOp",
    "TransferStats",
    "make_backend",
]
