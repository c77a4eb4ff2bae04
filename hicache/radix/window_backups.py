"""Host copies of the SWA rows of pages the engine still holds, made when those pages left
every future window of a running request (``HiRadixCache.back_up_window``).

The engine frees a page's SWA rows as soon as no later token can attend to it, long before
the request finishes and its pages join the tree. With ``host.swa_history: all`` those rows
are first copied to the SWA host pool; the copy waits here, keyed by the page's full device
page, until ``insert`` hands it to the node that takes the page (or ``free_device`` drops
it). Device SWA slots are freed when the copy is acknowledged. The copies of a step's
requests are one controller op: they wait in the controller's queue for the step's write.

Bookkeeping only (CPU); the scheduler thread owns it, under the service lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hicache.pools import IndexSpace, Indices
from hicache.pools.nonzero_count import count_nonzero

from .node import PendingOp


@dataclass(eq=False)
class WindowBackupOp(PendingOp):
    """The tag of one SWA-only backup of engine-held pages (``device``: their full slots)."""

    device: Indices = field(default_factory=lambda: Indices(
        torch.empty(0, dtype=torch.int64), IndexSpace.DEVICE_FULL))


class WindowBackups:
    """Full device page -> the host SWA slots of its rows, and the op still writing them.

    Held as arrays indexed by the page (grown to the highest page seen), so that a
    request's pages are added, looked up, acknowledged and taken with a few array
    operations each, not a Python step per page: a request's window backup names every
    page of its sequence before the window."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._host = np.zeros((0, page_size), dtype=np.int64)  # a page's host SWA slots
        self._held = np.zeros(0, dtype=bool)  # the page has a copy here
        self._writer = np.zeros(0, dtype=np.int64)  # the op writing it (0: acknowledged)
        self._op_ids: dict[WindowBackupOp, int] = {}  # ops not acknowledged yet
        self._next_id = 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, device: Indices, host_swa: Indices, op: WindowBackupOp) -> None:
        """Record the host SWA slots (aligned with ``device``, 0 = none) that ``op`` fills."""
        pages = self._pages(device)
        host = host_swa.tensor.numpy().reshape(-1, self.page_size)
        copied = host[:, 0] != 0
        pages, host = pages[copied], host[copied]
        if not pages.size:
            return
        self._grow(int(pages.max()) + 1)
        op_id = self._op_ids.get(op)
        if op_id is None:
            op_id = self._op_ids[op] = self._next_id
            self._next_id += 1
        self._count += int(pages.size - count_nonzero(self._held[pages]))
        self._host[pages] = host
        self._held[pages] = True
        self._writer[pages] = op_id

    def finish(self, op: WindowBackupOp) -> None:
        """``op`` was acknowledged: its host rows are complete."""
        op_id = self._op_ids.pop(op, None)
        if op_id is None:
            return
        pages = self._known(self._pages(op.device))
        writer = self._writer
        writer[pages[writer[pages] == op_id]] = 0

    def in_flight(self, device: Indices) -> bool:
        """True when a copy for one of the pages of ``device`` is not acknowledged yet."""
        if not self._op_ids:  # the common case; a model without SWA layers never has any
            return False
        return bool(count_nonzero(self._writer[self._known(self._pages(device))]))

    def take(self, device: Indices) -> Indices | None:
        """Remove the copies of ``device``'s pages (all acknowledged); aligned ``HOST_SWA``
        slots (0 for a page without one), or ``None`` when no page has one."""
        if not self._count:
            return None
        pages = self._pages(device)
        known = pages < self._held.size
        found = np.zeros(pages.size, dtype=bool)
        found[known] = self._held[pages[known]]
        if not count_nonzero(found):
            return None
        taken = pages[found]
        if count_nonzero(self._writer[taken]):  # callers wait for (or refuse) these first
            raise RuntimeError("window backups: a copy of these pages is still in flight")
        rows = np.zeros((pages.size, self.page_size), dtype=np.int64)
        rows[found] = self._host[taken]
        self._held[taken] = False
        self._host[taken] = 0
        self._count -= int(taken.size)
        return Indices(torch.from_numpy(rows.reshape(-1)), IndexSpace.HOST_SWA)

    def device_pages(self) -> np.ndarray:
        """The device pages whose SWA rows have a copy here (for integrity checks)."""
        return np.flatnonzero(self._held)

    def host_slots(self) -> Indices:
        """Every host SWA slot held here (for integrity checks: the engine holds them)."""
        slots = self._host[self._held].reshape(-1)  # a new array (a masked read)
        return Indices(torch.from_numpy(slots), IndexSpace.HOST_SWA)

    def _pages(self, device: Indices) -> np.ndarray:
        return device.tensor.numpy()[::self.page_size] // self.page_size

    def _known(self, pages: np.ndarray) -> np.ndarray:
        """``pages`` that have ever been added (the arrays reach them)."""
        return pages[pages < self._held.size]

    def _grow(self, num_pages: int) -> None:
        size = self._held.size
        if num_pages <= size:
            return
        grown = max(num_pages, 2 * size)
        self._host = np.concatenate((self._host, np.zeros((grown - size, self.page_size),
                                                          dtype=np.int64)))
        self._held = np.concatenate((self._held, np.zeros(grown - size, dtype=bool)))
        self._writer = np.concatenate((self._writer, np.zeros(grown - size, dtype=np.int64)))
