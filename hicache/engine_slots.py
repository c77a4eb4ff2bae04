"""Device pages the engine holds: handed out by the service, not yet inserted or freed.

The service tracks them so that the integrity check can prove conservation of the device
pool (free + tree-owned + engine-held == capacity) and so that ``insert`` and
``free_device`` refuse pages the engine does not hold (a slot freed twice, or a tree-owned
slot at the wrong position, would otherwise corrupt another request's KV rows).

Bookkeeping only, on CPU; the caller holds the service lock.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from hicache.pools import IndexSpace, Indices, PageAllocator
from hicache.pools.nonzero_count import count_nonzero
from hicache.pools.page_ids import owned_page_ids, valid_slot_pages

from .radix import RadixTree, TokenKey


class InsertSlots(NamedTuple):
    """What ``insert``'s check of the engine's slots found (:meth:`EngineSlots.check_insert`).

    ``pages``: page ids of the ``num_tokens`` slots inserted that the engine holds (what
    ``insert`` takes from it; the tree's own pages among the slots are not the engine's).
    ``slots``: those slots as an int64 numpy view of the engine's tensor (to read at once,
    never keep), or ``None`` when the check did not read them so. ``own_tokens``: leading
    tokens whose slots were compared slot for slot with the tree's own (none of them is a
    duplicate)."""

    pages: np.ndarray
    slots: np.ndarray | None
    own_tokens: int


class EngineSlots:
    """The set of ``DEVICE_FULL`` pages the engine holds.

    Args:
        allocator: the device full-pool allocator (validates whole pages).
    """

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        # held[p]: the engine holds page p (a map, so a check costs per page asked about,
        # not per page held)
        self._held = np.zeros(allocator.num_pages + 1, dtype=bool)
        self._num_held = 0

    @property
    def num_tokens(self) -> int:
        return self._num_held * self.allocator.page_size

    def pages_of(self, indices: Indices, op: str) -> np.ndarray:
        """Page ids of whole-page ``DEVICE_FULL`` ``indices``; ``ValueError`` otherwise."""
        return self.allocator.pages_of(indices, op=op)

    def add(self, indices: Indices, pages: np.ndarray | None = None) -> None:
        """Record freshly allocated slots; ``pages``: their page ids if the allocation
        handed them out (read off the slots otherwise)."""
        if pages is None:
            pages = owned_page_ids(indices, self.allocator.page_size)  # the allocator's output
        assert not count_nonzero(self._held[pages]), \
            "alloc_device handed out a page the engine holds"
        self._held[pages] = True
        self._num_held += int(pages.size)

    def held_pages(self, indices: Indices, op: str) -> np.ndarray:
        """Pages of ``indices``; ``ValueError`` for any the engine does not hold."""
        pages = self.pages_of(indices, op)
        stray = pages[~self._held[pages]]
        if stray.size:
            raise ValueError(
                f"{op}: page {int(stray[0])} was not handed out by alloc_device, or was "
                f"already inserted or freed"
            )
        return pages

    def insertable(
        self, tree: RadixTree, key: TokenKey, device_indices: Indices, num_tokens: int
    ) -> np.ndarray:
        """Pages of ``device_indices[:num_tokens]`` (``num_tokens``: the whole pages of
        ``key``) that the engine holds, in slot order; ``ValueError`` for a page that is
        neither held by the engine nor the tree's own page at the same position."""
        return self.check_insert(tree, key, device_indices, num_tokens).pages

    def check_insert(
        self, tree: RadixTree, key: TokenKey, device_indices: Indices, num_tokens: int
    ) -> InsertSlots:
        """:meth:`insertable`, with what the check learnt of the slots for the insert that
        follows (:class:`InsertSlots`)."""
        served = self._insertable_as_served(tree, key, device_indices, num_tokens)
        if served is not None:
            return served
        pages = self.insertable_by_page(tree, key, device_indices, num_tokens)
        return InsertSlots(pages[self._held[pages]], None, 0)

    def insertable_by_page(
        self, tree: RadixTree, key: TokenKey, device_indices: Indices, num_tokens: int
    ) -> np.ndarray:
        """:meth:`insertable` for any slots: every page checked and compared with the
        tree's page at its position (what the fast path hands over to)."""
        head = Indices(device_indices.tensor[:num_tokens], device_indices.space)
        pages = self.pages_of(head, "insert")
        own = tree.device_prefix_pages(key)  # the tree's own pages
        fine = self._held[pages]  # a new array: marked below where the tree's page is
        if own.size:
            fine[:own.size] |= pages[:own.size] == own
        if count_nonzero(fine) < fine.size:
            bad = np.flatnonzero(~fine)
            raise ValueError(
                f"insert: page {int(pages[bad[0]])} at token {int(bad[0]) * tree.page_size} "
                f"is neither held by the engine (alloc_device) nor the tree's page there"
            )
        return pages

    def _insertable_as_served(
        self, tree: RadixTree, key: TokenKey, device_indices: Indices, num_tokens: int
    ) -> InsertSlots | None:
        """:meth:`check_insert` of the slots a served request gives back: the
        tree's own slots of the cached prefix, byte for byte, then whole pages the engine
        holds (its ``alloc_device``). ``None`` for any other slots, which the page-by-page
        check then takes (and names what is wrong).

        The prefix is compared with the nodes' slots, which the tree keeps as whole ordered
        pages (checked when they entered it), so only the engine's part is checked page by
        page; the two cannot share a page (one is the tree's, the other the engine's), so
        the prefix's pages are not the engine's and are not looked up."""
        tensor = device_indices.tensor
        if (type(device_indices) is not Indices or device_indices.space is not
                IndexSpace.DEVICE_FULL or tensor.dtype is not torch.int64
                or tensor.dim() != 1 or not tensor.is_cpu or tensor.numel() < num_tokens):
            return None
        slots, at = tensor.numpy(), 0
        for node_slots in tree.device_prefix_views(key, "insert"):
            used = node_slots.size
            if count_nonzero(slots[at:at + used] != node_slots):
                return None  # the engine's own copy of a cached page: the general check
            at += used
        if at == num_tokens:  # whole pages: the key's, less the nodes' (whole pages too)
            return InsertSlots(np.empty(0, dtype=np.int64), slots[:num_tokens], at)
        held = valid_slot_pages(slots[at:num_tokens], self.allocator.page_size,
                                self.allocator.num_pages)
        if held is None or count_nonzero(self._held[held]) != held.size:
            return None
        return InsertSlots(held, slots[:num_tokens], at)

    def forget(self, pages: np.ndarray) -> None:
        """The engine no longer holds ``pages`` (inserted into the tree, or freed)."""
        held = self._held[pages]
        self._held[pages] = False
        self._num_held -= int(count_nonzero(held))

    def as_indices(self) -> Indices:
        """Every held slot as CPU int64 ``DEVICE_FULL`` indices (for integrity checks)."""
        page = self.allocator.page_size
        pages = np.flatnonzero(self._held).astype(np.int64)
        slots = (pages[:, None] * page + np.arange(page, dtype=np.int64)[None, :]).reshape(-1)
        return Indices(torch.from_numpy(slots), IndexSpace.DEVICE_FULL)
