"""Hybrid sliding-window pool: full-attention layers and SWA layers in two sub-pools.

A token always has a slot in the full sub-pool (``DEVICE_FULL``); while it is inside the
sliding window it also has a slot in the smaller SWA sub-pool (``DEVICE_SWA``). The
full-to-SWA slot map that joins them, and every translation from one space to the other,
is the pool's :class:`~hicache.pools.swa_map.SWASlotMap` (``slot_map``); this class owns the
two sub-pools and their allocators, sends each model layer to its sub-pool, and is what an
engine calls. Attention kernels get int32 SWA indices (:meth:`translate_full_to_swa`,
:meth:`translate_page_table`, :meth:`fill_decode_buffer`); the transfer path asks for int64
in ``move_indices``.

Which full page owns which SWA page is mirrored on the CPU: freeing never synchronises the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .allocator import PageAllocator
from .arg_checks import check_int
from .base import IndexSpace, Indices, PageTable
from .device import DeviceKVPool, LayerWaiter, RowGeometry
from .forward_locs import ForwardLocs
from .swa_map import SWASlotMap


class HybridSWAPool:
    """Full + SWA device pools with their allocators and the full-to-SWA map.

    Args:
        num_layers: model layers.
        swa_layers: model layer ids that use sliding-window attention.
        full_pages / swa_pages: usable pages of each sub-pool (page 0 reserved on top).
        page_size: slots per page (both sub-pools).
        geometry: row shape and dtype (same for both sub-pools).
        device: where rows and the map live.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        swa_layers: Sequence[int],
        full_pages: int,
        swa_pages: int,
        page_size: int,
        geometry: RowGeometry,
        device: torch.device | str,
    ) -> None:
        swa_set = set(swa_layers)
        if not swa_set or not swa_set < set(range(num_layers)):  # a full layer is left
            raise ValueError(
                f"swa_layers {sorted(swa_set)} must be a non-empty subset of 0..{num_layers - 1}"
                " that leaves the full pool at least one full-attention layer")
        self.num_layers = num_layers
        self.page_size = page_size
        self.device = torch.device(device)
        full_ids = [i for i in range(num_layers) if i not in swa_set]
        swa_ids = sorted(swa_set)
        # layer_mapping[model_layer] = (is_swa, local layer id in its sub-pool)
        self.layer_mapping: list[tuple[bool, int]] = [
            (True, swa_ids.index(i)) if i in swa_set else (False, full_ids.index(i))
            for i in range(num_layers)
        ]
        self.full_allocator = PageAllocator(full_pages, page_size, IndexSpace.DEVICE_FULL, "full")
        self.swa_allocator = PageAllocator(swa_pages, page_size, IndexSpace.DEVICE_SWA, "swa")
        self.full = DeviceKVPool(
            name="full", space=IndexSpace.DEVICE_FULL, num_layers=len(full_ids),
            num_slots=self.full_allocator.num_slots, geometry=geometry, device=self.device,
            page_size=page_size)
        self.swa = DeviceKVPool(
            name="swa", space=IndexSpace.DEVICE_SWA, num_layers=len(swa_ids),
            num_slots=self.swa_allocator.num_slots, geometry=geometry, device=self.device,
            page_size=page_size)
        self.device = self.full.device  # with its index ("cuda" -> "cuda:0")
        self.full.page_size = self.swa.page_size = page_size  # page tables are checked by it
        self.slot_map = SWASlotMap(self.full, self.full_allocator, self.swa_allocator)
        self.full_to_swa = self.slot_map.full_to_swa  # int64 [full slots] on the device
        self._layer_waiter: LayerWaiter | None = None

    @property
    def map_version(self) -> int:
        """Bumped by every change of the full-to-SWA map (stales :class:`ForwardLocs`)."""
        return self.slot_map.version

    # ---- allocation -------------------------------------------------------------------

    def try_alloc(self, num_tokens: int) -> Indices | None:
        """Full slots with an SWA slot each; ``None`` (nothing allocated) if either is short.

        Returns:
            int64 CPU ``DEVICE_FULL`` indices of shape ``[num_tokens]``.
        """
        allocated = self.full_allocator.try_alloc_pages(num_tokens)
        if allocated is None:
            return None
        full, pages = allocated
        if self.slot_map.try_alloc_swa_pages(pages) is None:
            self.full_allocator.free_pages(pages)
            return None
        return full

    def try_alloc_swa(self, full: Indices) -> Indices | None:
        """Give SWA slots to full slots that have none (whole pages); ``None`` if out of room.

        Returns:
            int64 CPU ``DEVICE_SWA`` indices aligned with ``full``.
        """
        return self.slot_map.try_alloc_swa(full)

    def free(self, full: Indices) -> None:
        """Free full slots and any SWA slots they still hold. Raises ``ValueError`` (freeing
        nothing) for slots that are not whole, allocated pages of the full pool."""
        self.free_pages(self.full_allocator.pages_of(
            full, op=f"free to pool '{self.full_allocator.name}'"))

    def free_pages(self, pages: np.ndarray) -> None:
        """:meth:`free` of full page ids that ``full_allocator.pages_of`` returned (or the
        tree's own pages): every page is checked allocated before anything is freed."""
        self.full_allocator.check_allocated(pages)
        self.slot_map.free_swa_pages(pages)
        self.full_allocator.free_pages(pages)

    def free_swa(self, full: Indices) -> None:
        """Release the SWA slots of full slots whose tokens left the window.

        Full pages without an SWA page are skipped, so calling it twice is harmless.
        """
        self.slot_map.free_swa(full)

    def free_swa_pages(self, pages: np.ndarray) -> None:
        """:meth:`free_swa` of checked full page ids."""
        self.slot_map.free_swa_pages(pages)

    def swa_slots_of_checked(self, full: Indices) -> Indices:
        """:meth:`swa_slots_of` of CPU full slots already checked in range."""
        return self.slot_map.swa_slots_of_checked(full)

    def swa_pages_of(self, pages: np.ndarray) -> np.ndarray:
        """SWA page id of each of the checked full page ids ``pages`` (0: none)."""
        return self.slot_map.swa_pages_of(pages)

    def swa_slots_of(self, full: Indices) -> Indices:
        """CPU int64 ``DEVICE_SWA`` slots of ``full`` (0 where a token has none); no GPU sync."""
        return self.slot_map.swa_slots_of(full)

    def check_integrity(self) -> None:
        """Both allocators are consistent and the map points only at allocated pages, each
        SWA page owned by exactly one full page; raises ``RuntimeError`` otherwise."""
        self.slot_map.check_integrity()

    # ---- translation --------------------------------------------------------------------

    def translate_full_to_swa(self, full: Indices) -> Indices:
        """SWA slots of ``full`` slots for attention kernels (bounds-checked, no cache).

        Args:
            full: ``[n]`` ``DEVICE_FULL`` indices on the pool's device.
        Returns:
            ``[n]`` int32 ``DEVICE_SWA`` indices on the same device; 0 where a token has no
            SWA slot (the padding slot). Empty in, empty out.
        """
        return self.slot_map.translate_full_to_swa(full)

    def forward_locs(self, out_cache_loc: Indices) -> ForwardLocs:
        """Check and translate a forward's new-token locations once, for every layer.

        Args:
            out_cache_loc: ``[n]`` ``DEVICE_FULL`` slots on the pool's device (padded rows 0).
        Returns:
            :class:`ForwardLocs` owning an int64 copy of the full slots and their int32 SWA
            translation. :meth:`set_kv` takes it for every layer without checking again, and
            refuses it once the full-to-SWA map has changed (make a new one then). Nothing
            is cached by the pool: an engine that refills its buffer in place makes a new
            handle per forward.
        """
        full = self.full.forward_locs(out_cache_loc).full
        swa = Indices(self.slot_map.swa_of(full.tensor), IndexSpace.DEVICE_SWA)
        return ForwardLocs(full, swa, self, self.map_version)

    def translate_page_table(self, page_table: PageTable) -> PageTable:
        """Translate a full-space page table to SWA page ids.

        Args:
            page_table: ``[batch, max_pages]`` ``DEVICE_FULL`` :class:`PageTable` on the
                pool's device; page 0 is padding.
        Returns:
            ``[batch, max_pages]`` int32 ``DEVICE_SWA`` :class:`PageTable`; 0 for padding and
            for pages whose tokens left the window.
        Raises:
            TypeError: a bare tensor (it carries no space).
            ValueError: an SWA-space table (translating twice), another page size or
                device; :class:`BoundsError` for a page outside the full pool (on CUDA at
                the next ``poll()``, the page read as padding meanwhile).
        """
        return self.slot_map.translate_page_table(page_table)

    def fill_decode_buffer(self, buffer: torch.Tensor, full: Indices) -> Indices:
        """Fill a preallocated (CUDA-graph) buffer with SWA locations and zero the tail.

        Everything is checked before the buffer is written (a refused call leaves it as it
        was). Nothing is cached: call it again after refilling ``full``.

        Args:
            buffer: ``[max_batch]`` int32 on the pool's device; may hold stale values.
            full: ``[n]`` ``DEVICE_FULL`` locations, ``n <= max_batch``.
        Returns:
            ``Indices`` over the whole buffer (``DEVICE_SWA``); rows ``n:`` are 0 (padding).
        """
        return self.slot_map.fill_decode_buffer(buffer, full)

    def raise_if_tripped(self) -> None:
        """Raise the error of a finished CUDA bounds check of either sub-pool (see
        :meth:`DeviceKVPool.raise_if_tripped`)."""
        self.full.raise_if_tripped()
        self.swa.raise_if_tripped()

    def page_slots(self, layer: int, table: PageTable, row: int) -> Indices:
        """Slots model ``layer`` reads for row ``row`` of ``table``: a full layer takes a
        ``DEVICE_FULL`` table, an SWA layer only a current ``DEVICE_SWA`` one (else raises)."""
        pool, _ = self.pool_of(layer)
        self.slot_map.check_current(table, f"page_slots(layer={layer})")
        return pool.page_slots(table, row)

    # ---- KV access ----------------------------------------------------------------------

    def register_layer_waiter(self, waiter: LayerWaiter | None) -> None:
        """Accessors wait once here, on the model layer id; the sub-pools never wait."""
        self._layer_waiter = waiter

    def is_swa_layer(self, layer: int) -> bool:
        return self.pool_of(layer)[0] is self.swa

    def pool_of(self, layer: int) -> tuple[DeviceKVPool, int]:
        """The sub-pool holding model ``layer`` and its local layer id."""
        if type(layer) is not int:
            layer = check_int(layer, "layer", "hybrid pool")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range (0..{self.num_layers - 1})")
        is_swa, local = self.layer_mapping[layer]
        return (self.swa if is_swa else self.full), local

    def key_buffer(self, layer: int) -> torch.Tensor:
        pool, local = self._waited(layer)
        return pool.key_buffer(local)

    def value_buffer(self, layer: int) -> torch.Tensor:
        pool, local = self._waited(layer)
        return pool.value_buffer(local)

    def latent_buffer(self, layer: int) -> torch.Tensor:
        pool, local = self._waited(layer)
        return pool.latent_buffer(local)

    def set_kv(
        self, layer: int, locs: Indices | ForwardLocs, k: torch.Tensor,
        v: torch.Tensor | None = None,
    ) -> None:
        """Write new tokens of model ``layer``. ``locs`` are ``DEVICE_FULL`` :class:`Indices`
        (checked, and translated for an SWA layer, on every call) or this forward's
        :class:`ForwardLocs` (checked and translated once). SWA layers write the translated
        SWA rows, never the full row index."""
        op = f"set_kv(layer={layer})"
        pool, local = self._waited(layer)
        if isinstance(locs, ForwardLocs):
            self._check_handle(locs, op)
            if pool is self.swa:
                assert locs.swa is not None
                index = locs.swa.tensor
            else:
                index = locs.full.tensor
        else:
            index = self.full.check(locs, op)
            if pool is self.swa:
                index = self.slot_map.swa_of(index)
        pool.write_rows(local, index, k, v)

    # ---- helpers --------------------------------------------------------------------------

    def _waited(self, layer: int) -> tuple[DeviceKVPool, int]:
        pool, local = self.pool_of(layer)
        if self._layer_waiter is not None:
            self._layer_waiter(layer)
        return pool, local

    def _check_handle(self, locs: ForwardLocs, op: str) -> None:
        if locs.owner is not self:
            raise ValueError(
                f"{op}: these ForwardLocs were made by another pool; make them with this "
                f"pool's forward_locs()"
            )
        if locs.map_version != self.map_version:
            raise ValueError(
                f"{op}: the full-to-SWA map changed after these ForwardLocs were made (SWA "
                f"slots were allocated or freed), so their SWA slots may belong to another "
                f"request now; call forward_locs() again after changing the map"
            )
