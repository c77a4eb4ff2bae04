"""Checks of the slots a controller call names: CPU :class:`Indices` of a space the
controller has a pool in, in range, whole allocated pages, and not held by an op the new
one would race. Each raises ``ValueError`` (``TypeError`` for a bare tensor) naming the
call, the pool, the slot and what to do; nothing is changed by a refused call.

Each check runs once, where the slots enter, and hands back their page ids (what the
in-flight counts and the allocators work in), so later steps of the same call do not check
them again.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.pools import (
    DeviceKVPool,
    HostKVPool,
    IndexSpace,
    Indices,
    PageAllocator,
    check_indices,
)

from .base import Direction
from .inflight import InFlightPages

CPU = torch.device("cpu")


class SlotChecks:
    """The checks, over the in-flight pages of one controller."""

    def __init__(self, held: InFlightPages) -> None:
        self.held = held

    def cpu(self, indices: Indices, pool: DeviceKVPool | HostKVPool, op: str) -> torch.Tensor:
        """The raw tensor of ``indices`` once they are CPU slots of ``pool`` in range."""
        return check_indices(indices, space=pool.space, pool_name=pool.name,
                             num_slots=pool.num_slots, device=CPU, op=op)

    def slots(self, indices: Indices, op: str) -> np.ndarray:
        """Raw numpy slots of ``indices``: CPU, a space this controller has, every value in
        range (numpy would wrap a negative index around)."""
        if not isinstance(indices, Indices):
            raise TypeError(f"{op}: expected hicache.pools.Indices, got {type(indices).__name__}")
        return self.cpu(indices, self.held.pool(indices.space, op), op).numpy()

    def pair(self, host_indices: Indices, device_indices: Indices, op: str
             ) -> tuple[HostKVPool, DeviceKVPool, torch.Tensor, torch.Tensor]:
        """The pools and raw tensors of aligned host and device slots (``cpu`` each)."""
        for indices in (host_indices, device_indices):
            if not isinstance(indices, Indices):
                raise TypeError(f"{op}: expected hicache.pools.Indices, got "
                                f"{type(indices).__name__}")
        host_pool = self.held.pool(host_indices.space, op)
        device_pool = self.held.pool(device_indices.space, op)
        if not isinstance(host_pool, HostKVPool) or not isinstance(device_pool, DeviceKVPool):
            raise ValueError(
                f"{op}: expected (host, device) indices, got spaces "
                f"({host_indices.space.name}, {device_indices.space.name})"
            )
        host = self.cpu(host_indices, host_pool, op)
        device = self.cpu(device_indices, device_pool, op)
        if host.numel() != device.numel():
            raise ValueError(f"{op}: {host.numel()} host indices but {device.numel()} device "
                             f"indices")
        return host_pool, device_pool, host, device

    def writable(self, device_indices: Indices, allocator: PageAllocator, op: str,
                 pages: np.ndarray | None = None) -> np.ndarray:
        """Pages of device slots to back up: whole, distinct, allocated pages that no op
        holds (``pages``: their ids, when the caller already has them checked)."""
        pages = owned_pages(device_indices, allocator, op,
                            "back up only device slots that are allocated and hold rows", pages)
        self.held.refuse_conflicts(device_indices.space, pages, op, Direction.DEVICE_TO_HOST)
        return pages

    def loadable(self, host_indices: Indices, allocator: PageAllocator, op: str,
                 pages: np.ndarray | None = None) -> np.ndarray:
        """Pages of host slots to load: whole, distinct, allocated pages that no write still
        fills (``pages``: their ids, when the caller already has them checked)."""
        pages = owned_pages(host_indices, allocator, op,
                            "load only host slots that write() returned and were not evicted",
                            pages)
        self.held.refuse_conflicts(host_indices.space, pages, op, Direction.HOST_TO_DEVICE)
        return pages

    def not_busy(self, indices: Indices, op: str) -> None:
        """Slots to free: none held by an op in flight."""
        slots = self.slots(indices, op)
        busy = slots[self.held.mask(indices.space, slots)]
        if busy.size:
            raise_busy(int(busy[0]), self.held.pool(indices.space, op).name, op)

    def freeable(self, indices: Indices, allocator: PageAllocator, op: str,
                 pages: np.ndarray | None = None) -> np.ndarray:
        """Pages of slots to free to ``allocator``: whole, distinct pages of its pool (the
        checks of ``PageAllocator.pages_of``, unless the caller gives their checked
        ``pages``) that no op in flight holds."""
        if pages is None:
            pages = allocator.pages_of(indices, op=op)
        self.pages_not_busy(indices.space, pages, allocator, op)
        return pages

    def pages_not_busy(self, space: IndexSpace, pages: np.ndarray, allocator: PageAllocator,
                       op: str) -> None:
        """Checked page ids of ``allocator``'s pool (in ``space``): none held by an op."""
        busy = self.held.first_busy_page(space, pages)
        if busy is not None:
            raise_busy(busy * allocator.page_size, allocator.name, op)


def raise_busy(slot: int, pool_name: str, op: str) -> None:
    raise ValueError(
        f"{op}: slot {slot} of pool '{pool_name}' belongs to a transfer in flight; evict it "
        f"after poll() acknowledged that transfer"
    )


def owned_pages(indices: Indices, allocator: PageAllocator, op: str, fix: str,
                pages: np.ndarray | None = None) -> np.ndarray:
    """Page ids of ``indices`` once they are whole, distinct pages of ``allocator``'s pool
    (space, range, page 0: ``PageAllocator.pages_of``, unless the caller gives their checked
    ``pages``) and every page is allocated."""
    if pages is None:  # checked here (range included): no second range check below
        pages, start = allocator.checked_pages_of(indices, op=op)
        slot = allocator.first_unallocated_page(pages, run_start=start, in_range=True)
    else:
        slot = allocator.first_unallocated_page(pages)
    if slot is not None:
        raise ValueError(
            f"{op}: {allocator.space.name} slot {slot * allocator.page_size} of pool "
            f"'{allocator.name}' is not allocated (never allocated, or already freed); {fix}"
        )
    return pages
