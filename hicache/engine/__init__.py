"""The reference engine: a tiny seeded decoder that embeds the cache service as a real
engine would, and ``hicache demo``, which proves end to end that history evicted to the
host and loaded back yields the tokens a recompute yields.

Modules: ``model`` (the decoder), ``attention`` (paged attention over the pools),
``workload`` (the conversations), ``request``, ``limits`` and ``runner`` (the scheduler that embeds
:class:`~hicache.service.HiCacheService`), ``reference`` (the dense baseline), ``verify``
(page digests and token comparison), ``report`` and ``demo`` (:func:`run_demo`).
"""

from .demo import DemoOptions, run_demo
from .limits import EngineError
from .model import ModelSpec, TinyDecoder
from .report import DemoReport
from .runner import DemoEngine
from .workload import WorkloadSpec, make_workload

__all__ = [
    "DemoEngine",
    "DemoOptions",
    "DemoReport",
    "EngineError",
    "ModelSpec",
    "TinyDecoder",
    "WorkloadSpec",
    "make_workload",
    "run_demo",
]
