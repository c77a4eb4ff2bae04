"""What the reference engine checks before it serves: its own arguments, and that the pools
can hold the largest allocation one request makes (a prefill chunk and a partial page),
so a config whose pools are too small fails at once with :class:`EngineError` naming the
key to raise, not with ``alloc_device``'s advice to its caller half way through a run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.config import WritePolicy
from hicache.pools import HybridSWAPool
from hicache.service import HiCacheService

if TYPE_CHECKING:  # demo imports this module
    from .demo import DemoOptions


class EngineError(RuntimeError):
    """The workload cannot be served with these pools (one line, names the limit)."""


def check_at_least_one(name: str, value: object) -> None:
    """``value`` is an int >= 1, else ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r:.40}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_demo_fields(options: DemoOptions) -> None:
    """The fields of ``DemoOptions`` other than its counts, each of its type, else
    ``TypeError`` naming the field (a string policy failed deep in the run; a flag of "no"
    was true and corrupted a host byte)."""
    seed = options.seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"DemoOptions.seed must be an int, got {type(seed).__name__} "
                        f"{seed!r:.40}")
    for name in ("quick", "corrupt_host_byte"):
        if not isinstance(getattr(options, name), bool):
            raise TypeError(f"DemoOptions.{name} must be True or False, got "
                            f"{getattr(options, name)!r:.40}")
    policy = options.write_policy
    if policy is not None and not isinstance(policy, WritePolicy):
        raise TypeError(f"DemoOptions.write_policy must be a WritePolicy or None, got "
                        f"{policy!r:.40}: e.g. WritePolicy('write_back')")
    for name in ("device", "storage"):
        value = getattr(options, name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"DemoOptions.{name} must be a string or None, got "
                            f"{value!r:.40}")


def check_room_for_a_chunk(service: HiCacheService, chunk_tokens: int) -> None:
    """``EngineError`` when a device pool (full, or SWA for a hybrid model) holds fewer
    tokens than a request's prefill chunk and the page it may start in."""
    page = service.tree.page_size
    need = chunk_tokens + page
    pools = [(service.controller.device_allocator.capacity_tokens, "device_pool.num_tokens")]
    pool = service.device_pool
    if isinstance(pool, HybridSWAPool):
        pools.append((pool.swa_allocator.capacity_tokens, "device_pool.swa_num_tokens"))
    for capacity, key in pools:
        if capacity < need:
            raise EngineError(
                f"the engine allocates up to {need} tokens for one request (a prefill chunk "
                f"of {chunk_tokens} and a page of {page}), but {key} holds {capacity}; raise "
                f"{key} to {need} or more")
