"""Checks of the slots a controller call names: CPU :class:`Indices` of a space the
controller has a pool in, in range, whole allocated pages, and not held by an op the new
one would race. Each raises ``ValueError`` (``TypeError`` for a bare tensor) naming the
call, the pool, the slot and what to do; nothing is changed by a refused call.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, Indices, PageAllocator, check_indices

from .base import Direction
from .inflight import InFlightSlots

CPU = torch.device("cpu")


class SlotChecks:
    """The checks, over the in-flight slots of one controller."""

    def __init__(self, held: InFlightSlots) -> None:
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

    def writable(self, device_indices: Indices, allocator: PageAllocator, op: str) -> None:
        """Device slots to back up: whole, distinct, allocated pages that no op holds."""
        slots = owned_slots(device_indices, allocator, op,
                            "back up only device slots that are allocated and hold rows")
        self.held.refuse_conflicts(device_indices.space, slots, op, Direction.DEVICE_TO_HOST)

    def loadable(self, host_indices: Indices, allocator: PageAllocator, op: str) -> None:
        """Host slots to load: whole, distinct, allocated pages that no write still fills."""
        slots = owned_slots(host_indices, allocator, op,
                            "load only host slots that write() returned and were not evicted")
        self.held.refuse_conflicts(host_indices.space, slots, op, Direction.HOST_TO_DEVICE)

    def not_busy(self, indices: Indices, op: str) -> None:
        """Slots to free: none held by an op in flight."""
        slots = self.slots(indices, op)
        busy = slots[self.held.mask(indices.space, slots)]
        if busy.size:
            raise ValueError(
                f"{op}: slot {int(busy[0])} of pool '{self.held.pool(indices.space, op).name}' "
                f"belongs to a transfer in flight; evict it after poll() acknowledged that "
                f"transfer"
            )


def owned_slots(indices: Indices, allocator: PageAllocator, op: str, fix: str) -> np.ndarray:
    """Raw numpy slots of ``indices`` once they are whole, distinct pages of ``allocator``'s
    pool (space, range, page 0: ``PageAllocator.pages_of``) and every page is allocated."""
    slot = allocator.first_unallocated(indices, op=op)
    if slot is not None:
        raise ValueError(
            f"{op}: {allocator.space.name} slot {slot} of pool '{allocator.name}' is not "
            f"allocated (never allocated, or already freed); {fix}"
        )
    return indices.tensor.numpy()
