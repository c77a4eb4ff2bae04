"""The cache controller: asynchronous, stream-safe page moves between host and device pools.

Protocol (names in call order)::

    write(device_indices)  -> host indices or None   queue a device-to-host op
    start_writing()                                   merge queued writes, issue on the write stream
    load(host_indices)     -> device indices or None  queue a host-to-device op
    start_loading()        -> event set id or None    issue in layer groups on the load stream
    start_transfers()      -> event set id or None    both at once: load group 0, writes, the rest
    wait_until(layer)                                 current stream waits for that layer (GPU-side)
    poll()                 -> [Ack]                   pools' bounds errors, then finished ops (FIFO)
    evict_device / evict_host                         free slots that are not in flight
    drain()                                           shutdown: issue and finish everything

Stream rules (DESIGN section 4): before a write the write stream waits on an event recorded
on every registered producer stream and on the current stream; before a load the load
stream does the same, so loads into reused slots never race the forward pass. Every tensor
a side stream reads (moved indices and temporaries) is recorded on that stream and held by
its op until the op is acknowledged. Slots in flight cannot be evicted.

Refusals (``ValueError``, nothing allocated or queued): ``write`` takes only allocated device
pages that no queued or in-flight op touches (a second backup of a page is a caller bug, and
a write of a page a load still fills would race it: the write stream does not wait for the
load stream); ``load`` takes only allocated host pages that no write is still filling (the
load stream does not wait for the write stream). Two loads may read one host page. In-flight
counts are kept per direction and index space and given back per queued call, so merged ops
balance them exactly.

Reading a layer while loads are queued but not started raises ``RuntimeError`` in
:meth:`CacheController.wait_until` (which every pool accessor calls) instead of starting
them: the accessor may run on any thread without the service lock, and issuing a transfer
from inside it would hide the ordering bug. Call ``start_loading()`` before the forward.

Thread ownership: one thread (the engine's scheduler) calls everything here, except
``wait_until``, which only reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy import count_nonzero

from hicache.pools import Indices

from .base import Direction
from .core import TransferCore
from .events import Event
from .index_moves import owned_pages_copy
from .op_queue import TransferObserver

__all__ = ["CacheController", "TransferObserver"]


class CacheController(TransferCore):
    """Moves pages of one full-attention pool pair (constructor: :class:`TransferCore`)."""

    def write(self, device_indices: Indices, tag: object = None, *,
              pages: np.ndarray | None = None, marks: Sequence[Event] = ()
              ) -> Indices | None:
        """Allocate host slots for ``device_indices`` and queue a device-to-host op.

        Args:
            device_indices: ``[n]`` CPU ``DEVICE_FULL`` slots (whole pages) to back up.
            tag: returned in the op's :class:`Ack` (e.g. a tree node id).
            pages: the page ids of ``device_indices`` from a caller holding slots already
                checked as whole pages (the radix tree); as for :meth:`evict_device`.
            marks: events from :meth:`mark_caller` the copy also waits on (it always waits
                on the stream current now).
        Returns:
            ``[n]`` CPU int64 ``HOST_FULL`` slots aligned with ``device_indices``, or
            ``None`` when the host pool is full (nothing queued). Empty in, empty out.
        Raises:
            ValueError: ``device_indices`` are not whole, distinct, allocated pages of the
                device pool, or a queued or in-flight op touches one of them (nothing is
                allocated or queued then).
        """
        device_pages = self._checks.writable(device_indices, self.device_allocator, "write",
                                             pages)
        return self._write(device_indices, device_pages, tag, marks, copies=True)

    def write_without_copies(self, device_indices: Indices, pages: np.ndarray,
                             tag: object = None, *, marks: Sequence[Event] = ()
                             ) -> Indices | None:
        """:meth:`write` for a caller that never changes ``device_indices`` or the host
        slots it gets back in place (the radix tree: a node's slot tensors are its own,
        replaced but never written): the op reads those two tensors as they are, where
        :meth:`write` makes copies of both. ``pages``: the caller's checked page ids of
        ``device_indices`` (whole pages in order, int64 slots). Every check of :meth:`write`
        runs (allocated, not in flight); returns and raises as it does."""
        device_pages = self._checks.writable(device_indices, self.device_allocator,
                                             "write_without_copies", pages)
        return self._write(device_indices, device_pages, tag, marks, copies=False)

    def _write(self, device_indices: Indices, device_pages: np.ndarray, tag: object,
               marks: Sequence[Event], copies: bool) -> Indices | None:
        """:meth:`write` past its checks; ``copies``: the op reads copies of the slots."""
        num_tokens = device_pages.size * self.device_allocator.page_size
        allocated = self.host_pool.allocator.try_alloc_pages(num_tokens)
        if allocated is None:
            return None
        host, host_pages = allocated
        if device_pages.size:  # the op's own copies (an allocation's slots are int64 already)
            page_size = self.device_allocator.page_size
            transfer = self._full_transfer(
                owned_pages_copy(host, host_pages, self.host_pool.page_size, True)
                if copies else host,
                owned_pages_copy(device_indices, device_pages, page_size) if copies or
                device_indices.tensor.dtype is not torch.int64 else device_indices)
            self._queue(Direction.DEVICE_TO_HOST, [transfer], tag, [(host_pages, device_pages)],
                        owned=True, marks=marks,
                        cancel=lambda: self.host_pool.allocator.free_pages(host_pages),
                        host_ascending=True)
        return host

    def load(self, host_indices: Indices, tag: object = None) -> Indices | None:
        """Allocate device slots for ``host_indices`` and queue a host-to-device op.

        Args:
            host_indices: ``[n]`` CPU ``HOST_FULL`` slots (whole pages) to bring back.
            tag: returned in the op's :class:`Ack`.
        Returns:
            ``[n]`` CPU int64 ``DEVICE_FULL`` slots, or ``None`` when the device pool is
            full (nothing queued). The rows are valid only after :meth:`wait_until` for
            each layer (or the op's ack).
        Raises:
            ValueError: ``host_indices`` are not whole, distinct, allocated pages of the host
                pool, or a queued or in-flight write is still filling one of them (nothing
                is allocated or queued then).
        """
        host_pages = self._checks.loadable(host_indices, self.host_pool.allocator, "load")
        return self._load(host_indices, host_pages, tag, copies=True)

    def load_without_copies(self, host_indices: Indices, pages: np.ndarray,
                            tag: object = None) -> Indices | None:
        """:meth:`load` for a caller that never changes ``host_indices`` or the device slots
        it gets back in place (the radix tree, as for :meth:`write_without_copies`): the op
        reads those two tensors as they are, where :meth:`load` makes copies of both (two
        copies of 256 KiB for a 32k-token load). ``pages``: the caller's checked page ids
        of ``host_indices`` (whole pages in order, int64 slots). Every check of :meth:`load`
        runs (allocated, no write filling them); returns and raises as it does."""
        host_pages = self._checks.loadable(host_indices, self.host_pool.allocator,
                                           "load_without_copies", pages)
        return self._load(host_indices, host_pages, tag, copies=False)

    def _load(self, host_indices: Indices, host_pages: np.ndarray, tag: object,
              copies: bool) -> Indices | None:
        """:meth:`load` past its checks; ``copies``: the op reads copies of the slots."""
        num_tokens = host_pages.size * self.host_pool.page_size
        allocated = self.device_allocator.try_alloc_pages(num_tokens)
        if allocated is None:
            return None
        device, device_pages = allocated
        if host_pages.size:
            # distinct (checked) and ascending pages are ascending slots: the backend need
            # not look for an order among the op's slots
            ascending = host_pages.size < 2 or not count_nonzero(host_pages[1:]
                                                                  <= host_pages[:-1])
            host = (owned_pages_copy(host_indices, host_pages, self.host_pool.page_size,
                                     ascending) if copies
                    or host_indices.tensor.dtype is not torch.int64 else host_indices)
            transfer = self._full_transfer(host, owned_pages_copy(
                device, device_pages, self.device_allocator.page_size, True)
                if copies else device)
            self._queue(Direction.HOST_TO_DEVICE, [transfer], tag, [(host_pages, device_pages)],
                        owned=True, cancel=lambda: self.device_allocator.free_pages(device_pages),
                        host_ascending=ascending)
        return device

    def evict_device(self, device_indices: Indices, *, pages: np.ndarray | None = None
                     ) -> None:
        """Free device slots. Raises ``ValueError`` if any is read or written by an op in
        flight (wait for its ack). ``pages``: their page ids, from a caller holding slots
        checked as whole pages (the radix tree's nodes): their form is not checked again;
        the allocation and in-flight checks always run."""
        allocator = self.device_allocator
        allocator.free_pages(self._checks.freeable(device_indices, allocator, "evict_device",
                                                   pages))

    def evict_host(self, host_indices: Indices, *, pages: np.ndarray | None = None) -> None:
        """Free host slots. Raises ``ValueError`` if any belongs to an op in flight.
        ``pages``: as for :meth:`evict_device`."""
        allocator = self.host_pool.allocator
        allocator.free_pages(self._checks.freeable(host_indices, allocator, "evict_host",
                                                   pages))
