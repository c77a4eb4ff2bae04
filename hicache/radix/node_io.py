"""How the radix tree asks the controller to move and free a node's slots, and takes over
the slots the engine gives to ``insert`` (checked, with the duplicates of its own pages found).

Two variants behind one interface: :class:`NodeIO` for full-attention models
(:class:`~hicache.controller.CacheController`) and :class:`HybridNodeIO` for sliding-window
models (:class:`~hicache.controller.HybridCacheController`), which also carries the aligned
SWA slots (0 = no SWA slot) of every op. The tree never branches on the model kind itself.

Safety contract: every method is called on the scheduler thread (the one that owns the
tree); frees go through the controller, which refuses slots that are still in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from hicache.controller import (
    CacheController,
    Event,
    HybridCacheController,
    HybridSlots,
    TransferCore,
)
from hicache.pools import IndexSpace, Indices, PageAllocator
from hicache.pools.nonzero_count import count_nonzero
from hicache.pools.page_ids import owned_page_ids

# (full slots, aligned SWA slots or None for a model without SWA)
SlotPair = tuple[Indices, Indices | None]


class NodeIO:
    """Slot moves of a full-attention model: ``*_swa`` values are always ``None``."""

    is_hybrid = False
    keeps_swa_history = False
    tail_tokens = 0

    controller: TransferCore

    def __init__(self, controller: CacheController) -> None:
        self.controller = controller
        self.plain = controller  # its write and load (a hybrid controller has its own)
        self.page_size = controller.device_allocator.page_size

    def try_alloc_device(self, num_tokens: int) -> tuple[Indices, np.ndarray | None] | None:
        """``[num_tokens]`` fresh ``DEVICE_FULL`` slots (whole pages) with their page ids
        (int64, a new array, slot order; ``None`` where the pool does not hand them out), or
        ``None`` when there is no room."""
        return self.controller.device_allocator.try_alloc_pages(num_tokens)

    def backup(self, device: Indices, tag: object, host_swa: Indices | None = None,
               marks: Sequence[Event] = ()) -> SlotPair | None:
        """Queue a device-to-host copy of ``device``; the host slots, or ``None`` if full.
        ``host_swa``: the SWA host copies the tokens already have (hybrid; kept, merged
        into the returned SWA slots). ``marks``: events of :meth:`mark_caller` the copy
        waits on (a backup the tree queued earlier)."""
        # the tree never writes a node's slots in place: the op reads them as they are
        host = self.plain.write_without_copies(device, self._pages(device), tag, marks=marks)
        return None if host is None else (host, None)

    def mark_caller(self) -> Event | None:
        """An event on the caller's current stream for a later :meth:`backup` to wait on
        (``None`` on a CPU)."""
        return self.controller.mark_caller()

    def load(self, host: Indices, host_swa: Indices | None, tag: object,
             restore: SlotPair | None = None) -> SlotPair | None:
        """Queue a host-to-device copy; the new device slots, or ``None`` if the device is
        full. ``restore`` (hybrid): device slots before ``host`` whose SWA rows come back
        from their host copies in the same op."""
        device = self.plain.load_without_copies(host, self._pages(host), tag)
        return None if device is None else (device, None)

    def take_slots(self, device_indices: Indices, num_tokens: int) -> Indices:
        """The first ``num_tokens`` of the slots the engine gives to ``insert``, checked
        (``DEVICE_FULL`` CPU indices, enough of them, all allocated), as int64 (a view of
        int64 slots: the tree copies the parts it keeps).

        Raises:
            ValueError: any of those checks fails (the message starts with ``insert:``).
        """
        if not isinstance(device_indices, Indices) or \
                device_indices.space is not IndexSpace.DEVICE_FULL:
            raise ValueError("insert: device_indices must be DEVICE_FULL hicache.pools.Indices")
        if len(device_indices) < num_tokens or device_indices.device.type != "cpu":
            raise ValueError(
                f"insert: need >= {num_tokens} CPU slots (the whole pages of the tokens), got "
                f"{len(device_indices)} on {device_indices.device}"
            )
        slots = Indices(device_indices.tensor[:num_tokens].to(torch.int64),
                        IndexSpace.DEVICE_FULL)
        if not self.controller.device_allocator.is_allocated(slots):
            raise ValueError("insert: some slots are not allocated; insert only slots you hold")
        return slots

    def differing_pages(self, mine: Indices, given: np.ndarray) -> Indices | None:
        """The slots of the pages of ``given`` (the caller's ``DEVICE_FULL`` slots, int64)
        that are not the tree's page at the same position (``mine``: a node's slots; both
        whole ordered pages, aligned, so a page is named by its first slot); ``None`` when
        every page is the tree's. That common case, the engine handing the tree's own pages
        back, costs two strided numpy reads and a comparison, and makes no tensor. A new
        tensor otherwise, never a view of ``given``."""
        size = self.page_size
        differ = mine.tensor.numpy()[::size] != given[::size]
        if not count_nonzero(differ):
            return None
        return Indices(torch.from_numpy(given.reshape(-1, size)[differ].reshape(-1)),
                       IndexSpace.DEVICE_FULL)

    def write_swa(self, device: Indices, tag: object) -> Indices | None:
        """Queue a copy of only the SWA rows of ``device`` (hybrid); aligned host SWA slots
        (0 where a token has no SWA slot), or ``None`` when the SWA host pool is full."""
        raise NotImplementedError("a full-attention model has no SWA rows")

    def free_host_swa(self, host_swa: Indices | None) -> None:
        """Free aligned SWA host slots (0 entries skipped)."""

    def host_swa_free_tokens(self) -> int:
        """Free tokens of the SWA host pool (0 without SWA)."""
        return 0

    def host_free_tokens(self) -> int:
        """Free tokens of the (full-attention) host pool."""
        return self.controller.host_pool.allocator.num_free_tokens

    def try_alloc_host_swa(self, num_tokens: int) -> Indices | None:
        """``[num_tokens]`` fresh ``HOST_SWA`` slots (whole pages), or ``None`` (hybrid)."""
        raise NotImplementedError("a full-attention model has no SWA rows")

    def device_swa_free_tokens(self) -> int:
        """Free tokens of the device SWA pool (0 without SWA)."""
        return 0

    def free_device(self, device: Indices) -> None:
        """Free device slots (and their SWA slots); raises if any is in flight."""
        self.plain.evict_device(device, pages=self._pages(device))

    def free_host(self, host: Indices, host_swa: Indices | None) -> None:
        """Free host slots (and aligned SWA host slots); raises if any is in flight."""
        self.plain.evict_host(host, pages=self._pages(host))

    def _pages(self, slots: Indices) -> np.ndarray:
        """Page ids of slots the tree holds: whole pages, checked when they entered it (an
        allocation, or the engine's slots at ``insert``) and sliced only at page
        boundaries since (the controller still checks that every page is allocated and not
        in flight)."""
        return owned_page_ids(slots, self.page_size)

    def swa_of(self, device: Indices) -> Indices | None:
        """Aligned ``DEVICE_SWA`` slots of ``device`` (``None`` without SWA): slots the tree
        holds, or the engine's once checked (not checked again)."""
        return None

    def window_start(self, num_tokens: int) -> int:
        """First token of the SWA window tail of a ``num_tokens`` sequence (0 without SWA)."""
        return 0

    def release_swa(self, device: Indices) -> None:
        """Give back the SWA slots of ``device`` (tokens that left the window)."""

    def tail_has_swa(self, host_swa: Indices | None) -> bool:
        """True when every token of the window tail of a load has an SWA host copy."""
        return True

    def allocators(self) -> dict[IndexSpace, PageAllocator]:
        """Allocator of every index space a node can own slots in."""
        return {
            IndexSpace.DEVICE_FULL: self.controller.device_allocator,
            IndexSpace.HOST_FULL: self.controller.host_pool.allocator,
        }

    def check_pools(self, sync_device: bool) -> None:
        """Pool-level integrity (allocators, maps); raises ``RuntimeError``. With
        ``sync_device`` also checks device-side state (a GPU round trip)."""
        for allocator in self.allocators().values():
            allocator.check_integrity()

    def device_state_check(self) -> Callable[[], None] | None:
        """The device-side half of :meth:`check_pools`, taken under the service lock (copies,
        no GPU wait), to run later with no lock (it waits for the GPU); ``None``: no SWA."""
        return None

    def engine_swa_slots(self, engine_device: Indices) -> Indices | None:
        """SWA slots held through engine-owned full slots (``None`` without SWA)."""
        return None


class HybridNodeIO(NodeIO):
    """Slot moves of a hybrid model: full and SWA rows travel in one op.

    Args:
        controller: the hybrid controller.
        window_tokens: the sliding window; the tree keeps SWA rows for the last
            ``window_tokens`` rounded up to whole pages (``tail_tokens``) of each sequence.
    """

    is_hybrid = True

    def __init__(self, controller: HybridCacheController, window_tokens: int,
                 keep_swa_history: bool = True) -> None:
        self.controller = controller
        self.page_size = controller.device_allocator.page_size
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1 for a hybrid model, got {window_tokens}")
        self.hybrid = controller
        self.pool = controller.hybrid_pool
        self.tail_tokens = -(-window_tokens // self.page_size) * self.page_size
        self.keeps_swa_history = keep_swa_history

    def try_alloc_device(self, num_tokens: int) -> tuple[Indices, np.ndarray | None] | None:
        slots = self.pool.try_alloc(num_tokens)
        return None if slots is None else (slots, None)

    def backup(self, device: Indices, tag: object, host_swa: Indices | None = None,
               marks: Sequence[Event] = ()) -> SlotPair | None:
        have = None if host_swa is None else host_swa.tensor != 0
        slots = self.hybrid.write(device, tag, swa_skip=have, marks=marks)
        if slots is None:
            return None
        if host_swa is None or have is None:
            return slots.full, slots.swa
        merged = torch.where(have, host_swa.tensor.to(torch.int64), slots.swa.tensor)
        return slots.full, Indices(merged, IndexSpace.HOST_SWA)

    def load(self, host: Indices, host_swa: Indices | None, tag: object,
             restore: SlotPair | None = None) -> SlotPair | None:
        assert host_swa is not None, "a hybrid load needs aligned SWA host slots"
        restore_slots = None
        if restore is not None and len(restore[0]):
            assert restore[1] is not None, "a restore needs aligned SWA host slots"
            restore_slots = HybridSlots(restore[0], restore[1])
        slots = self.hybrid.load(host, host_swa, self.tail_tokens, tag, restore=restore_slots)
        return None if slots is None else (slots.full, slots.swa)

    def write_swa(self, device: Indices, tag: object) -> Indices | None:
        return self.hybrid.write_swa(device, tag)

    def host_swa_free_tokens(self) -> int:
        return self.hybrid.host_swa.allocator.num_free_tokens

    def try_alloc_host_swa(self, num_tokens: int) -> Indices | None:
        return self.hybrid.host_swa.allocator.try_alloc(num_tokens)

    def device_swa_free_tokens(self) -> int:
        return self.pool.swa_allocator.num_free_tokens

    def free_host_swa(self, host_swa: Indices | None) -> None:
        if host_swa is None:
            return
        swa = host_swa.tensor[host_swa.tensor != 0]
        if swa.numel():
            self.hybrid.host_swa_evict(Indices(swa.to(torch.int64), IndexSpace.HOST_SWA))

    def free_device(self, device: Indices) -> None:
        self.hybrid.evict_device(device, pages=owned_page_ids(device, self.page_size))

    def free_host(self, host: Indices, host_swa: Indices | None) -> None:
        self.hybrid.evict_host(host, host_swa)

    def swa_of(self, device: Indices) -> Indices | None:
        return self.pool.swa_slots_of_checked(device)  # slots the tree holds or checked

    def window_start(self, num_tokens: int) -> int:
        return num_tokens - min(num_tokens, self.tail_tokens)

    def release_swa(self, device: Indices) -> None:
        if len(device):
            self.pool.free_swa_pages(owned_page_ids(device, self.page_size))

    def tail_has_swa(self, host_swa: Indices | None) -> bool:
        assert host_swa is not None, "a hybrid load needs aligned SWA host slots"
        tail = min(len(host_swa), self.tail_tokens)
        return bool((host_swa.tensor[len(host_swa) - tail:] != 0).all())

    def allocators(self) -> dict[IndexSpace, PageAllocator]:
        return {
            IndexSpace.DEVICE_FULL: self.pool.full_allocator,
            IndexSpace.DEVICE_SWA: self.pool.swa_allocator,
            IndexSpace.HOST_FULL: self.hybrid.host_pool.allocator,
            IndexSpace.HOST_SWA: self.hybrid.host_swa.allocator,
        }

    def check_pools(self, sync_device: bool) -> None:
        super().check_pools(sync_device)
        slot_map = self.pool.slot_map
        slot_map.check_host_state()  # the map against the allocators (CPU)
        if sync_device:  # and the device map against its mirror
            slot_map.check_mirror(slot_map.mirror_snapshot())

    def device_state_check(self) -> Callable[[], None] | None:
        snapshot, slot_map = self.pool.slot_map.mirror_snapshot(), self.pool.slot_map
        return lambda: slot_map.check_mirror(snapshot)

    def engine_swa_slots(self, engine_device: Indices) -> Indices | None:
        swa = self.pool.swa_slots_of(engine_device).tensor
        return Indices(swa[swa != 0].to(torch.int64), IndexSpace.DEVICE_SWA)
