"""Full-to-SWA slot map of a hybrid pool: which SWA slot each full slot holds.

A token always has a slot in the full sub-pool (``DEVICE_FULL``); while it is inside the
sliding window it also has a slot in the smaller SWA sub-pool (``DEVICE_SWA``). The int64
map ``full_to_swa[full_slot]`` joins them; 0 means "no SWA slot" and points at the reserved
padding slot of the SWA sub-pool. Mapping is page-aligned: page ``p`` of the full pool maps
to a whole page ``q`` of the SWA pool, slot by slot.

:class:`SWASlotMap` is the only place that makes ``DEVICE_SWA`` indices (the hybrid pool,
:class:`hicache.pools.swa.HybridSWAPool`, hands them out through it): it gives SWA pages to
full pages and takes them back, and translates full slots and page tables for attention
kernels (int32) and the transfer path (int64 host lookups).

Bookkeeping (which full page owns which SWA page) reads a CPU mirror of the device map, so
allocating and freeing never synchronise the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .allocator import PageAllocator
from .base import IndexSpace, Indices, PageTable, check_indices
from .device import DeviceKVPool
from .nonzero_count import count_nonzero

CPU = torch.device("cpu")


class MirrorSnapshot(NamedTuple):
    """Copies of the map's CPU mirror and of its device map taken together
    (:meth:`SWASlotMap.mirror_snapshot`); ``copied``: the CUDA event of the device copy."""

    host: np.ndarray
    device: torch.Tensor
    copied: torch.cuda.Event | None


class SWASlotMap:
    """The full-to-SWA map on the device, its CPU mirror, and the SWA allocations behind it.

    Args:
        full: the full device sub-pool (checks full-space indices; its device holds the map).
        full_allocator: allocator of ``full`` (``DEVICE_FULL`` pages).
        swa_allocator: allocator of the SWA sub-pool (``DEVICE_SWA`` pages), same page size.
    """

    def __init__(
        self, full: DeviceKVPool, full_allocator: PageAllocator, swa_allocator: PageAllocator
    ) -> None:
        self.full = full
        self.full_allocator = full_allocator
        self.swa_allocator = swa_allocator
        self.page_size = full_allocator.page_size
        self.device = full.device
        self.full_to_swa = torch.zeros(full.num_slots, dtype=torch.int64, device=self.device)
        self.full_to_swa_host = np.zeros(full.num_slots, dtype=np.int64)
        self.version = 0  # bumped by every change of the map (stales ForwardLocs)
        self._cuda = self.full_to_swa.is_cuda
        # the stream of the latest map write (CUDA), current then on the writing thread
        self._writer: torch.cuda.Stream | None = (
            torch.cuda.current_stream(self.device) if self._cuda else None)

    # ---- bookkeeping --------------------------------------------------------------------

    def try_alloc_swa(self, full: Indices) -> Indices | None:
        """SWA pages for the whole pages of ``full``, none of which may have one yet;
        ``None`` (nothing allocated) if the SWA allocator is short.

        Returns:
            int64 CPU ``DEVICE_SWA`` indices aligned with ``full``.
        """
        return self.try_alloc_swa_pages(self.full_allocator.pages_of(full, op="try_alloc_swa"))

    def try_alloc_swa_pages(self, pages: np.ndarray) -> Indices | None:
        """:meth:`try_alloc_swa` of full page ids that ``full_allocator.pages_of`` returned
        (or that it handed out itself)."""
        if self.full_allocator.first_unallocated_page(pages) is not None:
            raise ValueError("try_alloc_swa: some full slots are not allocated in pool 'full'")
        if count_nonzero(self.swa_pages_of(pages)):
            raise ValueError("try_alloc_swa: some full slots already have an SWA slot")
        swa = self.swa_allocator.try_alloc(pages.size * self.page_size)
        if swa is None:
            return None
        self._set(self._slots_of_pages(pages), swa.tensor.numpy())
        return swa

    def free_swa(self, full: Indices) -> None:
        """Free the SWA pages of the pages of ``full``; pages without one are skipped."""
        self.free_swa_pages(self.full_allocator.pages_of(full, op="free_swa"))

    def free_swa_pages(self, pages: np.ndarray) -> None:
        """:meth:`free_swa` of full page ids that ``full_allocator.pages_of`` returned. The
        SWA pages are the map's own (whole pages, one full page each), freed by id."""
        swa_pages = self.swa_pages_of(pages)
        mapped = swa_pages != 0
        count = int(count_nonzero(mapped))
        if not count:
            return
        if count < pages.size:
            pages, swa_pages = pages[mapped], swa_pages[mapped]
        self.swa_allocator.free_pages(swa_pages)
        self._set(self._slots_of_pages(pages), np.zeros(count * self.page_size, dtype=np.int64))

    def swa_pages_of(self, pages: np.ndarray) -> np.ndarray:
        """SWA page id of each full page id of ``pages`` (checked, in range; 0: none). The
        map is page-aligned, so a page's first slot names its SWA page."""
        return self.full_to_swa_host[pages * self.page_size] // self.page_size

    def swa_slots_of(self, full: Indices) -> Indices:
        """CPU int64 ``DEVICE_SWA`` slots of ``full`` (0 where a token has none); no GPU sync."""
        full_slots = self._host_full(full, "swa_slots_of")
        return Indices(torch.from_numpy(self.full_to_swa_host[full_slots]),  # a new array
                       IndexSpace.DEVICE_SWA)

    def swa_slots_of_checked(self, full: Indices) -> Indices:
        """:meth:`swa_slots_of` of CPU full slots already checked in range (the tree's own,
        or a caller's after its page checks): no check again."""
        return Indices(torch.from_numpy(self.full_to_swa_host[full.tensor.numpy()]),
                       IndexSpace.DEVICE_SWA)

    def check_integrity(self) -> None:
        """Both allocators are consistent and the map points only at allocated pages, each
        SWA page owned by exactly one full page, and the device map equals its CPU mirror;
        raises ``RuntimeError`` otherwise (waits for the GPU)."""
        self.check_host_state()
        self.check_mirror(self.mirror_snapshot())

    def check_host_state(self) -> None:
        """:meth:`check_integrity` of the CPU state alone (no GPU wait): under the lock that
        serialises the map's changes."""
        self.full_allocator.check_integrity()
        self.swa_allocator.check_integrity()
        mapped = np.flatnonzero(self.full_to_swa_host)
        swa_pages = np.unique(self.full_to_swa_host[mapped] // self.page_size)
        used_swa = self.swa_allocator.used_pages()
        if not np.array_equal(swa_pages, used_swa):
            raise RuntimeError(
                f"swa pool: {used_swa.size} pages allocated but {swa_pages.size} mapped"
            )
        if mapped.size != swa_pages.size * self.page_size:
            raise RuntimeError("swa pool: an SWA page is mapped from more than one full page")
        full_pages = np.unique(mapped // self.page_size)
        if not np.isin(full_pages, self.full_allocator.used_pages()).all():
            raise RuntimeError("swa pool: a free full page still maps to an SWA page")

    def mirror_snapshot(self) -> MirrorSnapshot:
        """The CPU mirror and the device map as they are now, for :meth:`check_mirror` to
        compare later on any thread: taken under the lock that serialises the map's changes,
        without a GPU wait (on CUDA the device map's copy is enqueued after the latest map
        write, on the stream that made it)."""
        host = self.full_to_swa_host.copy()
        writer = self._writer
        if writer is None:
            return MirrorSnapshot(host, self.full_to_swa.clone(), None)
        device = torch.empty(self.full_to_swa.shape, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(writer):
            device.copy_(self.full_to_swa, non_blocking=True)
            done = torch.cuda.Event()
            done.record(writer)
        return MirrorSnapshot(host, device, done)

    @staticmethod
    def check_mirror(snapshot: MirrorSnapshot) -> None:
        """``RuntimeError`` unless a :meth:`mirror_snapshot`'s device map equals its mirror
        (waits for the copy)."""
        if snapshot.copied is not None:
            snapshot.copied.synchronize()
        if not np.array_equal(snapshot.device.numpy(), snapshot.host):
            raise RuntimeError("swa pool: device map differs from its host mirror")

    # ---- translation ----------------------------------------------------------------------

    def swa_of(self, full_index: torch.Tensor) -> torch.Tensor:
        """int32 SWA slots of checked full slots (one gather on the map's device; nothing
        cached)."""
        return self.full_to_swa[full_index.to(torch.int64)].to(torch.int32)

    def translate_full_to_swa(self, full: Indices) -> Indices:
        """``[n]`` int32 ``DEVICE_SWA`` slots of ``[n]`` ``DEVICE_FULL`` slots on the map's
        device, bounds-checked (see :meth:`HybridSWAPool.translate_full_to_swa`)."""
        index = self.full.check(full, "translate_full_to_swa")
        return Indices(self.swa_of(index), IndexSpace.DEVICE_SWA)

    def translate_page_table(self, page_table: PageTable) -> PageTable:
        """``[batch, max_pages]`` int32 ``DEVICE_SWA`` table of a ``DEVICE_FULL`` one (see
        :meth:`HybridSWAPool.translate_page_table` for what is refused)."""
        op = "translate_page_table"
        if not isinstance(page_table, PageTable):
            raise TypeError(
                f"{op}: expected a DEVICE_FULL PageTable, got {type(page_table).__name__}; wrap "
                f"a table of full-pool pages as PageTable(tensor, IndexSpace.DEVICE_FULL, "
                f"page_size)"
            )
        if page_table.space is not IndexSpace.DEVICE_FULL:
            raise ValueError(
                f"{op}: the table is already in {page_table.space.name} space; only full-space "
                f"tables are translated (translating twice reads another request's pages)"
            )
        if page_table.page_size != self.page_size or page_table.tensor.device != self.device:
            raise ValueError(
                f"{op}: the table has pages of {page_table.page_size} on "
                f"{page_table.tensor.device}; this pool has pages of {self.page_size} on "
                f"{self.device}"
            )
        table = page_table.tensor
        if table.numel() == 0:
            swa = torch.empty(table.shape, dtype=torch.int32, device=self.device)
        else:
            pages = self.full.guard.check(table, bound=self.full.num_slots // self.page_size,
                                          op=op, unit="page")
            swa = (self.full_to_swa[pages.to(torch.int64) * self.page_size]
                   // self.page_size).to(torch.int32)
        return PageTable(swa, IndexSpace.DEVICE_SWA, self.page_size, self.version)

    def check_current(self, table: object, op: str) -> None:
        """Refuse an SWA page table translated before the map last changed: its pages may
        be another request's now (a stale cached translation)."""
        if isinstance(table, PageTable) and table.space is IndexSpace.DEVICE_SWA \
                and table.map_version != self.version:
            raise ValueError(f"{op}: this SWA page table was translated with map version "
                             f"{table.map_version}, the map is at {self.version}; translate "
                             f"the full-space table again")

    def fill_decode_buffer(self, buffer: torch.Tensor, full: Indices) -> Indices:
        """Write the SWA slots of ``full`` into ``buffer`` and zero its tail, after checking
        everything (see :meth:`HybridSWAPool.fill_decode_buffer`)."""
        if buffer.dtype != torch.int32 or buffer.device != self.device or buffer.dim() != 1:
            raise ValueError(
                f"fill_decode_buffer: buffer must be 1-D int32 on {self.device}, got "
                f"{buffer.dtype} {tuple(buffer.shape)} on {buffer.device}"
            )
        if len(full) > buffer.numel():
            raise ValueError(
                f"fill_decode_buffer: {len(full)} locations do not fit a buffer of "
                f"{buffer.numel()}"
            )
        swa = self.translate_full_to_swa(full).tensor
        n = swa.numel()
        buffer[:n].copy_(swa)
        buffer[n:].zero_()
        return Indices(buffer, IndexSpace.DEVICE_SWA)

    # ---- helpers --------------------------------------------------------------------------

    def _host_full(self, full: Indices, op: str) -> np.ndarray:
        tensor = check_indices(
            full, space=IndexSpace.DEVICE_FULL, pool_name="full",
            num_slots=self.full.num_slots, device=CPU, op=op,
        )
        return tensor.numpy().astype(np.int64, copy=False)

    def _slots_of_pages(self, pages: np.ndarray) -> np.ndarray:
        offsets = np.arange(self.page_size, dtype=np.int64)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def _set(self, full_slots: np.ndarray, swa_slots: np.ndarray) -> None:
        if not full_slots.size:  # nothing changes: the version (ForwardLocs, tables) stays
            return
        self.full_to_swa_host[full_slots] = swa_slots
        full_t = torch.from_numpy(full_slots.copy()).to(self.device, non_blocking=True)
        swa_t = torch.from_numpy(swa_slots.astype(np.int64)).to(self.device, non_blocking=True)
        self.full_to_swa[full_t] = swa_t
        if self._cuda:  # where the next mirror snapshot copies the map from
            self._writer = torch.cuda.current_stream(self.device)
        self.version += 1
