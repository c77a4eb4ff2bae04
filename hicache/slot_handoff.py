"""Device slots handed between the engine and the tree, under the service's scheduler calls.

The engine gets fresh pages from ``alloc_device`` (:func:`check_alloc`, :func:`alloc`) and
holds them (:class:`~hicache.engine_slots.EngineSlots` records which) until it gives them to
the tree with ``insert`` (:func:`insert`) or back with ``free_device`` (:func:`free`). For
a hybrid model, ``release_window`` (:func:`release_window`) gives back the SWA slots of held
pages that left every future window; under ``host.swa_history: all`` their SWA rows are
first copied to the host, and those copies follow the pages: ``insert`` hands them to the
tree, ``free_device`` frees them, both after waiting for copies still in flight
(:func:`finish_window_backups`).

Plain functions of :class:`~hicache.service.HiCacheService` (its methods call them): on the
scheduler thread, with the service lock held, except :func:`check_alloc`, which reads no
state that a call changes and runs before the lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache.pools import HybridSWAPool, IndexSpace, Indices
from hicache.pools.base import check_indices

from .radix import TokenIds, TokenKey

if TYPE_CHECKING:
    from .service import HiCacheService


def check_alloc(service: HiCacheService, num_tokens: int) -> int:
    """``num_tokens`` rounded up to whole pages, once it is a request ``alloc_device`` can
    ever meet; ``TypeError``/``ValueError`` as documented there, before anything changes."""
    num_tokens = check_count("alloc_device", num_tokens)
    pool = service.device_pool
    capacity, pool_name, key = (service.controller.device_allocator.capacity_tokens, "device",
                                "device_pool.num_tokens")
    if isinstance(pool, HybridSWAPool) and pool.swa_allocator.capacity_tokens < capacity:
        capacity, pool_name, key = (pool.swa_allocator.capacity_tokens, "device SWA",
                                    "device_pool.swa_num_tokens")
    if num_tokens > capacity:
        raise ValueError(
            f"alloc_device: {num_tokens} tokens exceed the {pool_name} pool's capacity of "
            f"{capacity} tokens; allocate at most {capacity} tokens per call, or raise {key}"
        )
    page = service.tree.page_size
    return -(-int(num_tokens) // page) * page


def check_count(op: str, value: object, name: str = "num_tokens") -> int:
    """``value``, a count of tokens passed to ``op``, as an int: ``TypeError`` for anything
    but an int (a bool, float, NaN or string), ``ValueError`` for a negative one; both name
    ``op`` and the argument."""
    if type(value) is int and value >= 0:  # the engine's case; a bool's type is bool
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} "
                        f"{value!r:.40}")
    if value < 0:
        raise ValueError(f"{op}: {name} must be >= 0, got {value}")
    return int(value)


def alloc(service: HiCacheService, num_tokens: int) -> Indices | None:
    """``num_tokens`` (whole pages, from :func:`check_alloc`) fresh device slots, evicting
    once if needed, recorded as the engine's; ``None`` when there is still no room."""
    tree = service.tree
    got = tree.io.try_alloc_device(num_tokens)
    if got is None and tree.io.is_hybrid and service.controller.has_queued_writes:
        # window backups wait for the step's write; their SWA slots come back at its ack
        if service._poller.agreement is None:
            service.controller.start_writing()
            service._poller.apply(service._poller.collect())
        else:  # tensor-parallel ranks: only every write finished is the same on every rank
            apply_finished_writes(service)
        got = tree.io.try_alloc_device(num_tokens)
    if got is None and tree.io.is_hybrid:  # SWA rows with a host copy go first
        swa_short = num_tokens - tree.io.device_swa_free_tokens()
        if swa_short > 0 and tree.evict_swa(swa_short) > 0:
            got = tree.io.try_alloc_device(num_tokens)
    if got is None:
        short = num_tokens - service.controller.device_allocator.num_free_tokens
        tree.evict(short if short > 0 else num_tokens)
        apply_acks(service)
        got = tree.io.try_alloc_device(num_tokens)
    if got is None:
        return None
    slots, pages = got
    service._engine.add(slots, pages)
    return slots


def apply_acks(service: HiCacheService) -> None:
    """Apply the acks of ops finished so far (an eviction's write-back frees device slots
    at its ack). With no op in flight the controller has none to give, and only acks the
    background thread took before are applied (none, in most calls): no poll is made."""
    poller = service._poller
    if poller.agreement is not None:  # a TP rank: acks are applied where the ranks agree
        return
    if service.controller.num_in_flight:
        poller.apply(poller.collect())
        return
    acks = poller.drain()
    if acks:
        poller.apply(acks)


def insert(service: HiCacheService, tokens: TokenIds | TokenKey, device_indices: Indices) -> int:
    """The engine's pages (or the tree's own, at their positions) of ``tokens`` go to the
    tree, with the host SWA copies made of them; tokens already cached. ``device_indices``
    are :class:`Indices` (``HiCacheService.insert`` refuses anything else first)."""
    tree = service.tree
    key = tree.key(tokens, "insert")  # checked once, reused below
    num_tokens, num_slots = key.num_page_tokens, len(device_indices)
    if num_slots < num_tokens:
        raise ValueError(f"insert: {num_slots} slots for {num_tokens} tokens")
    if num_slots > num_tokens and device_indices.tensor.device.type == "cpu":
        # the partial page's slots: in range
        allocator = service.controller.device_allocator
        check_indices(Indices(device_indices.tensor[num_tokens:], device_indices.space),
                      space=IndexSpace.DEVICE_FULL, pool_name=allocator.name,
                      num_slots=allocator.num_slots, device=None, op="insert")
    checked = service._engine.check_insert(tree, key, device_indices, num_tokens)
    own_tokens = checked.own_tokens
    if finish_window_backups(service, device_indices):
        own_tokens = 0  # the acks it applied may have changed the tree since the check
    # Every page is the engine's (so allocated) or the tree's own: what take_slots checks.
    # No copy here: the tree copies the parts it keeps (see HiRadixCache.insert_slots).
    given = checked.slots
    if given is None:
        given = device_indices.tensor[:num_tokens].to(torch.int64).numpy()
    cached = tree.insert_slots(key.data, given, own_tokens)  # frees duplicates' SWA copies
    service._engine.forget(checked.pages)
    return cached


def free(service: HiCacheService, device_indices: Indices) -> None:
    """The engine gives back pages it never inserted, and the host SWA copies made of them."""
    pages = service._engine.held_pages(device_indices, "free_device")
    finish_window_backups(service, device_indices)
    service.controller.evict_device(device_indices, pages=pages)
    service.tree.io.free_host_swa(service.tree.window_backups.take(device_indices))
    service._engine.forget(pages)


def release_window(service: HiCacheService, device_indices: Indices) -> None:
    """The SWA slots of engine-held pages that left every future window go (see
    ``HiCacheService.release_window``)."""
    service._engine.held_pages(device_indices, "release_window")
    tree = service.tree
    if not tree.io.is_hybrid:
        return
    if tree.window_backups.in_flight(device_indices):
        raise ValueError("release_window: a page of these was given back already and its "
                         "SWA rows are still being copied to the host; give each page back "
                         "once, when it leaves the window")
    tree.back_up_window(device_indices)


def finish_window_backups(service: HiCacheService, device_indices: Indices) -> bool:
    """Wait for the window backups of these engine pages still in flight (a short wait for
    copies already issued) and apply them, so that ``insert`` and ``free_device`` see
    complete host copies; True when there were any (acks were applied)."""
    tree = service.tree
    if tree.io.is_hybrid and tree.window_backups.in_flight(device_indices):
        apply_finished_writes(service)
        if tree.window_backups.in_flight(device_indices):  # before the caller changes anything
            raise RuntimeError("a window backup of these pages is still in flight after every "
                               "write finished and its ack was applied: its ack was lost; "
                               "stop the service")
        return True
    return False


def apply_finished_writes(service: HiCacheService) -> None:
    """Issue the queued writes, wait for every write in flight and apply their acks (with
    a :class:`~hicache.rank_agreement.RankAgreement`, every write's: each rank has them all
    then, so no collective is needed)."""
    service.controller.finish_writes()
    poller = service._poller
    acks = poller.collect()
    poller.apply(acks if poller.agreement is None else poller.agreement.take_writes())
