"""Hybrid controller for sliding-window + full-attention caches.

Each op carries the full-attention transfer (every full layer) plus an SWA pool transfer
(every SWA layer) whose device slots come from the full-to-SWA map and whose host slots come
from the SWA host pool. Slots are exchanged as :class:`HybridSlots`, aligned token by token
with 0 meaning "no SWA slot", so a tree node can split its slots at any page boundary.

Loads give SWA device slots only to the window tail (the last ``swa_tail_tokens`` tokens,
rounded up to pages); an op any of whose allocations fails rolls them all back (``None``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, HybridSWAPool, IndexSpace, Indices

from .aligned_slots import (
    cat_space,
    checked_skip,
    empty_indices,
    in_tail,
    scatter_aligned,
    tail_start,
)
from .base import Direction, HybridSlots, MovedTransfer, PoolTransfer, TransferBackend, TransferOp
from .core import TransferCore
from .events import Event
from .index_moves import owned_pages_copy
from .slot_checks import owned_pages


class HybridCacheController(TransferCore):
    """Moves full and SWA rows of a :class:`HybridSWAPool` in one op.

    Args:
        hybrid_pool: the device pools, allocators and full-to-SWA map.
        host_full: host pool of the full layers (``HOST_FULL``).
        host_swa: host pool of the SWA layers (``HOST_SWA``).
        backend, producer_streams, event_ring_size: as for :class:`TransferCore`.
    """

    def __init__(
        self,
        *,
        hybrid_pool: HybridSWAPool,
        host_full: HostKVPool,
        host_swa: HostKVPool,
        backend: TransferBackend,
        producer_streams: Sequence[torch.cuda.Stream] = (),
        event_ring_size: int = 3,
    ) -> None:
        self.hybrid_pool = hybrid_pool
        self.host_swa = host_swa
        mapping = hybrid_pool.layer_mapping
        self.swa_layers = tuple(i for i, (is_swa, _) in enumerate(mapping) if is_swa)
        super().__init__(
            device_pool=hybrid_pool.full,
            device_allocator=hybrid_pool.full_allocator,
            host_pool=host_full,
            backend=backend,
            producer_streams=producer_streams,
            event_ring_size=event_ring_size,
            full_layers=tuple(i for i, (is_swa, _) in enumerate(mapping) if not is_swa),
            num_model_layers=hybrid_pool.num_layers,
        )

    def write(self, device_indices: Indices, tag: object = None, *,
              swa_skip: torch.Tensor | None = None, marks: Sequence[Event] = ()
              ) -> HybridSlots | None:
        """Back up full rows of ``device_indices`` and SWA rows of those tokens that still
        have SWA slots.

        Args:
            device_indices: ``[n]`` CPU ``DEVICE_FULL`` slots (whole pages).
            swa_skip: ``[n]`` bool, True for tokens whose SWA rows already have a host copy
                (not backed up again; their returned SWA slot is 0).
            marks: as for :meth:`CacheController.write`.
        Returns:
            host :class:`HybridSlots` (``HOST_FULL``, ``HOST_SWA`` with 0 for tokens without
            an SWA slot), or ``None`` when either host pool is full (nothing allocated).
        Raises:
            ValueError: as :meth:`CacheController.write`, for the full slots and for the SWA
                slots they map to (nothing is allocated or queued then).
        """
        self._checks.writable(device_indices, self.device_allocator, "write")
        device_swa = self.hybrid_pool.swa_slots_of_checked(device_indices)
        mapped = device_swa.tensor != 0
        if swa_skip is not None:  # checked before anything is allocated
            mapped &= ~checked_skip(swa_skip, mapped, self.hybrid_pool.page_size)
        swa_part = Indices(device_swa.tensor[mapped], IndexSpace.DEVICE_SWA)
        self._held.refuse_slot_conflicts(IndexSpace.DEVICE_SWA, swa_part.tensor.numpy(), "write",
                                         Direction.DEVICE_TO_HOST)
        host_full = self.host_pool.allocator.try_alloc(len(device_indices))
        if host_full is None:
            return None
        host_swa_part = self.host_swa.allocator.try_alloc(int(mapped.sum()))
        if host_swa_part is None:
            self.host_pool.allocator.free(host_full)
            return None
        host_swa = scatter_aligned(host_swa_part, mapped, IndexSpace.HOST_SWA)
        if len(host_full):
            transfers = [self._full_transfer(host_full, device_indices),
                         self._swa_transfer(host_swa_part, swa_part)]
            self._queue(Direction.DEVICE_TO_HOST, transfers, tag, marks=marks,
                        cancel=lambda: self.evict_host(host_full, host_swa))
        return HybridSlots(host_full, host_swa)

    def load(
        self, host_indices: Indices, host_swa: Indices, swa_tail_tokens: int, tag: object = None,
        *, restore: HybridSlots | None = None,
    ) -> HybridSlots | None:
        """Bring back full rows of every token and SWA rows of the window tail.

        Args:
            host_indices: ``[n]`` CPU ``HOST_FULL`` slots (whole pages).
            host_swa: ``[n]`` CPU ``HOST_SWA`` slots aligned with ``host_indices`` (0 = none);
                every token of the tail must have one.
            swa_tail_tokens: tokens at the end that need SWA rows (the window), rounded up
                to whole pages and capped at ``n``.
            restore: SWA rows for device-resident tokens before the loaded span (the part of
                the window that lies in the device prefix): ``full`` their allocated
                ``DEVICE_FULL`` slots (whole pages) without an SWA slot, ``swa`` their aligned
                ``HOST_SWA`` backups (none 0). They get new SWA slots (read them with
                ``hybrid_pool.swa_slots_of``) filled by the same op. ``host_indices`` may be
                empty then.
        Returns:
            device :class:`HybridSlots` (``DEVICE_FULL``, ``DEVICE_SWA`` aligned, 0 outside
            the tail), or ``None`` when either device pool is short; then nothing stays
            allocated.
        Raises:
            ValueError: misaligned ``host_swa``, a tail token without an SWA host slot, or
                (as :meth:`CacheController.load`) full or tail SWA host slots that are not
                allocated pages or that a write is still filling; nothing allocated then.
        """
        self._checks.cpu(host_indices, self.host_pool, "load")  # shape errors first
        swa_host = self._checks.cpu(host_swa, self.host_swa, "load")
        if swa_host.numel() != len(host_indices):
            raise ValueError(
                f"load: host_swa has {swa_host.numel()} slots for {len(host_indices)} tokens; "
                f"pass them aligned (0 where a token has no SWA slot)"
            )
        # the tail is a suffix: slices (views), not masks (a masked read or store costs
        # 10-25 us each at a request's size)
        start = tail_start(len(host_indices), swa_tail_tokens, self.hybrid_pool.page_size)
        swa_tail_host = swa_host[start:]
        if swa_tail_host.numel() and bool((swa_tail_host.numpy() == 0).any()):
            raise ValueError(
                "load: a token of the window tail has no SWA host slot; its SWA rows were "
                "never backed up, so it cannot be restored (recompute it instead)"
            )
        host_pages = self._checks.loadable(host_indices, self.host_pool.allocator, "load")
        swa_tail = Indices(swa_tail_host, IndexSpace.HOST_SWA)
        restore_full, restore_host = self._check_restore(restore)
        swa_sources = cat_space([swa_tail, restore_host], IndexSpace.HOST_SWA)
        swa_host_pages = self._checks.loadable(swa_sources, self.host_swa.allocator, "load")
        allocated = self.device_allocator.try_alloc_pages(len(host_indices))
        if allocated is None:
            return None
        device_full, device_pages = allocated
        tail_full = Indices(device_full.tensor[start:], IndexSpace.DEVICE_FULL)
        swa_full = cat_space([tail_full, restore_full], IndexSpace.DEVICE_FULL)
        device_swa_part = self.hybrid_pool.try_alloc_swa(swa_full)
        if device_swa_part is None:
            self.device_allocator.free(device_full)
            return None
        def cancel() -> None:
            self.hybrid_pool.free_swa(swa_full)
            self.device_allocator.free(device_full)

        if len(device_full) or len(restore_full):
            # the op's own copies of every slot tensor a caller holds (the slots returned
            # included), with the pages checked or allocated above: none found again
            page = self.hybrid_pool.page_size
            swa_pages = device_swa_part.tensor.numpy()[::page] // page  # fresh, whole pages
            transfers = [
                self._full_transfer(
                    owned_pages_copy(host_indices, host_pages, self.host_pool.page_size),
                    owned_pages_copy(device_full, device_pages, self.device_allocator.page_size,
                                     True)),
                self._swa_transfer(
                    owned_pages_copy(swa_sources, swa_host_pages, self.host_swa.page_size),
                    owned_pages_copy(device_swa_part, swa_pages, page))]
            self._queue(Direction.HOST_TO_DEVICE, transfers, tag,
                        [(host_pages, device_pages), (swa_host_pages, swa_pages)], owned=True,
                        cancel=cancel)
        span_swa = Indices(device_swa_part.tensor[:len(swa_tail)], IndexSpace.DEVICE_SWA)
        return HybridSlots(device_full, in_tail(span_swa, len(device_full), start,
                                                 IndexSpace.DEVICE_SWA))

    def write_swa(self, device_indices: Indices, tag: object = None) -> Indices | None:
        """Back up only the SWA rows of ``device_indices`` (the tokens that have an SWA
        slot), so they can be freed on the device while their full rows stay.

        Args:
            device_indices: ``[n]`` CPU ``DEVICE_FULL`` slots (whole, allocated pages).
        Returns:
            ``[n]`` CPU ``HOST_SWA`` slots aligned with ``device_indices`` (0 for tokens
            without an SWA slot), or ``None`` when the SWA host pool is full (nothing
            allocated). The host rows are valid once the op is acknowledged.
        Raises:
            ValueError: as :meth:`write` for the SWA slots (nothing allocated or queued).
        """
        pages = owned_pages(device_indices, self.device_allocator, "write_swa",
                            "back up only device slots that are allocated and hold rows")
        swa_pages = self.hybrid_pool.swa_pages_of(pages)  # by page: the map is page-aligned
        have = swa_pages != 0
        swa_pages, page = swa_pages[have], self.hybrid_pool.page_size
        self._held.refuse_conflicts(IndexSpace.DEVICE_SWA, swa_pages, "write_swa",
                                    Direction.DEVICE_TO_HOST)
        allocated = self.host_swa.allocator.try_alloc_pages(swa_pages.size * page)
        if allocated is None:
            return None
        if swa_pages.size:  # the op's own tensors: the caller gets a scattered copy
            swa = np.add.outer(swa_pages * page, np.arange(page, dtype=np.int64)).reshape(-1)
            none = np.empty(0, dtype=np.int64)
            swa_part = Indices(torch.from_numpy(swa), IndexSpace.DEVICE_SWA)
            transfers = [
                self._full_transfer(empty_indices(IndexSpace.HOST_FULL),
                                    empty_indices(IndexSpace.DEVICE_FULL)),
                self._swa_transfer(allocated[0], swa_part),
            ]
            self._queue(Direction.DEVICE_TO_HOST, transfers, tag,
                        [(none, none), (allocated[1], swa_pages)], owned=True,
                        cancel=lambda: self.host_swa.allocator.free_pages(allocated[1]))
        mapped = torch.from_numpy(np.repeat(have, page))
        return scatter_aligned(allocated[0], mapped, IndexSpace.HOST_SWA)

    def _check_restore(self, restore: HybridSlots | None) -> tuple[Indices, Indices]:
        """The device full slots and host SWA slots of a load's SWA restore, checked:
        allocated whole full pages without an SWA slot, aligned host SWA slots, none 0."""
        if restore is None:
            return empty_indices(IndexSpace.DEVICE_FULL), empty_indices(IndexSpace.HOST_SWA)
        owned_pages(restore.full, self.device_allocator, "load (restore)",
                    "restore only device slots the tree owns")
        host = self._checks.cpu(restore.swa, self.host_swa, "load (restore)")
        if host.numel() != len(restore.full):
            raise ValueError(f"load (restore): {host.numel()} HOST_SWA slots for "
                             f"{len(restore.full)} device slots; pass them aligned")
        if bool((host == 0).any()):
            raise ValueError("load (restore): a token to restore has no SWA host slot")
        if bool((self.hybrid_pool.swa_slots_of(restore.full).tensor != 0).any()):
            raise ValueError("load (restore): a device slot to restore already has an SWA "
                             "slot; restore only tokens whose SWA rows left the device")
        return restore.full, Indices(host.to(torch.int64), IndexSpace.HOST_SWA)

    def move_hybrid_indices(self, op: TransferOp) -> list[MovedTransfer]:
        """Normalise the primary and every pool transfer's indices of ``op``."""
        return self.move_op_indices(op)

    def evict_device(self, device_indices: Indices, *, pages: np.ndarray | None = None) -> None:
        """Free full slots and their SWA slots, page by page; raises if any is in flight.
        ``pages``: as for :meth:`CacheController.evict_device`."""
        pool, op = self.hybrid_pool, "evict_device"
        pages = self._checks.freeable(device_indices, self.device_allocator, op, pages)
        swa = pool.swa_pages_of(pages)
        self._checks.pages_not_busy(IndexSpace.DEVICE_SWA, swa[swa != 0], pool.swa_allocator, op)
        pool.free_pages(pages)

    def evict_host(self, host_indices: Indices, host_swa: Indices | None = None) -> None:
        """Free host full slots and as many aligned SWA host slots (0 entries skipped)."""
        self._checks.not_busy(host_indices, "evict_host")
        full, swa = self.host_pool.allocator, self.host_swa.allocator
        pages = full.pages_of(host_indices, op="evict_host")
        full.check_allocated(pages)  # both parts checked before either is freed
        swa_pages = None
        if host_swa is not None:
            swa_slots = self._checks.cpu(host_swa, self.host_swa, "evict_host")
            if swa_slots.numel() != len(host_indices):
                raise ValueError(f"evict_host: {swa_slots.numel()} HOST_SWA slots for "
                                 f"{len(host_indices)} full ones; pass them aligned (0: none)")
            swa_indices = Indices(swa_slots[swa_slots != 0], IndexSpace.HOST_SWA)
            self._checks.not_busy(swa_indices, "evict_host")
            swa_pages = swa.pages_of(swa_indices, op="evict_host")
            swa.check_allocated(swa_pages)
        full.free_pages(pages)
        if swa_pages is not None:
            swa.free_pages(swa_pages)

    def host_swa_evict(self, host_swa: Indices) -> None:
        """Free SWA host slots on their own (whole pages; none in flight)."""
        self._checks.not_busy(host_swa, "host_swa_evict")
        self.host_swa.allocator.free(host_swa)

    def _paged_pools(self) -> list[tuple[DeviceKVPool | HostKVPool, int]]:
        return [(self.device_pool, self.device_allocator.page_size),
                (self.hybrid_pool.swa, self.hybrid_pool.swa_allocator.page_size),
                (self.host_pool, self.host_pool.page_size),
                (self.host_swa, self.host_swa.page_size)]

    def _swa_transfer(self, host: Indices, device: Indices) -> PoolTransfer:
        return PoolTransfer(
            name=self.hybrid_pool.swa.name, host_pool=self.host_swa,
            device_pool=self.hybrid_pool.swa, host_indices=host, device_indices=device,
            layers=self.swa_layers,
        )
