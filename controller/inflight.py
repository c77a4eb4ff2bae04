"""Which slots queued or issued transfer ops hold: per direction and index space, a count of
ops per slot, so eviction can refuse a slot in flight and a new op can refuse a slot another
op would race.

Bookkeeping only (numpy on the CPU, no stream). Counts are taken and given back per queued
call (``TransferOp.held``), where no slot repeats, so ops merged from several calls balance
exactly even when two calls name one host slot.

Conflicts refused for a new op (the side streams do not wait for each other):

- a write's device slots must not be held by another write (a second backup of a page) or
  by a load (the write would read rows the load has not placed yet);
- a load's host slots must not be held by a write (the load would read rows the write has
  not placed yet). Two loads may read one host page.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hicache.pools import DeviceKVPool, HostKVPool, IndexSpace

from .base import Direction, PoolTransfer, TransferOp

Pool = DeviceKVPool | HostKVPool

_CONFLICTS: dict[Direction, tuple[tuple[Direction, str], ...]] = {
    Direction.DEVICE_TO_HOST: (
        (Direction.DEVICE_TO_HOST, "is already being backed up by a queued or in-flight "
         "write; back a page up once (its host copy comes with that write's ack)"),
        (Direction.HOST_TO_DEVICE, "is still being filled by a queued or in-flight load; "
         "back it up after poll() acknowledged that load (the write stream does not wait "
         "for the load stream)"),
    ),
    Direction.HOST_TO_DEVICE: (
        (Direction.DEVICE_TO_HOST, "is still being filled by a queued or in-flight write; "
         "load it after poll() acknowledged that write (the load stream does not wait for "
         "the write stream)"),
    ),
}


class InFlightSlots:
    """Per-slot counts of the ops that hold each slot of the controller's pools.

    Args:
        pools: every pool the controller moves rows of (one per index space).
    """

    def __init__(self, pools: Sequence[Pool]) -> None:
        self._pools = {pool.space: pool for pool in pools}
        self._counts: dict[Direction, dict[IndexSpace, np.ndarray]] = {
            d: {pool.space: np.zeros(pool.num_slots, dtype=np.int32) for pool in pools}
            for d in Direction
        }
        # the queued calls holding slots now, by id (a merged op holds its calls' transfers)
        self._held: dict[int, PoolTransfer] = {}

    def pool(self, space: IndexSpace, op: str) -> Pool:
        """The pool of ``space``; ``ValueError`` naming the spaces there are otherwise."""
        pool = self._pools.get(space)
        if pool is None:
            have = ", ".join(s.name for s in self._pools)
            raise ValueError(
                f"{op}: this controller has no pool in index space {space.name}; it has {have}"
            )
        return pool

    def add(self, op: TransferOp, delta: int) -> None:
        """Take (``+1``) or give back (``-1``) the slots of every call ``op`` carries."""
        counts = self._counts[op.direction]
        for transfer in op.held:
            if delta > 0:
                self._held[id(transfer)] = transfer
            else:
                self._held.pop(id(transfer), None)
            for indices in (transfer.host_indices, transfer.device_indices):
                slots = indices.tensor.numpy()
                if not slots.all():  # padding (0) entries of a hybrid op
                    slots = slots[slots != 0]
                # Fancy-index += counts a repeated slot once: fine per queued call, where the
                # entry checks leave no repeats (np.add.at: ~6 ms per 32k slots).
                counts[indices.space][slots] += delta

    def mask(self, space: IndexSpace, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` (checked, in range) any op holds."""
        return (self._counts[Direction.DEVICE_TO_HOST][space][slots] > 0) | (
            self._counts[Direction.HOST_TO_DEVICE][space][slots] > 0)

    def held_slots(self, space: IndexSpace) -> np.ndarray:
        """Every slot of ``space`` an op holds, ascending (from the ops themselves, so the
        cost follows the slots in flight, not the pool's size)."""
        self.pool(space, "busy_slots")
        parts = [indices.tensor.numpy() for transfer in self._held.values()
                 for indices in (transfer.host_indices, transfer.device_indices)
                 if indices.space == space]
        slots = np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
        return slots[slots != 0].astype(np.int64, copy=False)

    def refuse_conflicts(self, space: IndexSpace, slots: np.ndarray, op: str,
                         new_op: Direction) -> None:
        """Raise ``ValueError`` if an op that a new ``new_op`` op would race holds one of
        ``slots`` (the source slots of the new op)."""
        for direction, why in _CONFLICTS[new_op]:
            held = slots[self._counts[direction][space][slots] > 0]
            if held.size:
                raise ValueError(
                    f"{op}: {space.name} slot {int(held[0])} of pool "
                    f"'{self.pool(space, op).name}' {why}"
                )
