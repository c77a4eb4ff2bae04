"""Host copies of the SWA rows of pages the engine still holds, made when those pages left
every future window of a running request (``HiRadixCache.back_up_window``).

The engine frees a page's SWA rows as soon as no later token can attend to it, long before
the request finishes and its pages join the tree. With ``host.swa_history: all`` those rows
are first copied to the SWA host pool; the copy waits here, keyed by the page's full device
page, until ``insert`` hands it to the node that takes the page (or ``free_device`` drops
it). Device SWA slots are freed when the copy is acknowledged.

Bookkeeping only (CPU); the scheduler thread owns it, under the service lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hicache.pools import IndexSpace, Indices

from .node import PendingOp


@dataclass(eq=False)
class WindowBackupOp(PendingOp):
    """The tag of one SWA-only backup of engine-held pages (``device``: their full slots)."""

    device: Indices = field(default_factory=lambda: Indices(
        torch.empty(0, dtype=torch.int64), IndexSpace.DEVICE_FULL))


class WindowBackups:
    """Full device page -> the host SWA slots of its rows, and the op still writing them."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._entries: dict[int, tuple[np.ndarray, WindowBackupOp | None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, device: Indices, host_swa: Indices, op: WindowBackupOp) -> None:
        """Record the host SWA slots (aligned with ``device``, 0 = none) that ``op`` fills."""
        full = device.tensor.numpy().reshape(-1, self.page_size)
        host = host_swa.tensor.numpy().reshape(-1, self.page_size)
        for page_slots, page_host in zip(full, host, strict=True):
            if page_host[0] != 0:
                self._entries[int(page_slots[0]) // self.page_size] = (page_host.copy(), op)

    def finish(self, op: WindowBackupOp) -> None:
        """``op`` was acknowledged: its host rows are complete."""
        for page in self._pages(op.device):
            entry = self._entries.get(page)
            if entry is not None and entry[1] is op:
                self._entries[page] = (entry[0], None)

    def in_flight(self, device: Indices) -> bool:
        """True when a copy for one of the pages of ``device`` is not acknowledged yet."""
        if not self._entries:  # the common case; a model without SWA layers never has any
            return False
        return any(self._entries.get(page, (None, None))[1] is not None
                   for page in self._pages(device))

    def take(self, device: Indices) -> Indices | None:
        """Remove the copies of ``device``'s pages (all acknowledged); aligned ``HOST_SWA``
        slots (0 for a page without one), or ``None`` when no page has one."""
        if not self._entries:
            return None
        pages = self._pages(device)
        found = [self._entries.pop(page, None) for page in pages]
        if all(entry is None for entry in found):
            return None
        zeros = np.zeros(self.page_size, dtype=np.int64)
        parts = []
        for entry in found:
            assert entry is None or entry[1] is None, "take() of a copy still in flight"
            parts.append(zeros if entry is None else entry[0])
        return Indices(torch.from_numpy(np.concatenate(parts)), IndexSpace.HOST_SWA)

    def host_slots(self) -> Indices:
        """Every host SWA slot held here (for integrity checks: the engine holds them)."""
        parts = [host for host, _ in self._entries.values()]
        slots = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return Indices(torch.from_numpy(slots.astype(np.int64)), IndexSpace.HOST_SWA)

    def _pages(self, device: Indices) -> list[int]:
        return [int(s) // self.page_size for s in device.tensor[::self.page_size].tolist()]
