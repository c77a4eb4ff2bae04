"""The part every cache controller shares (see :mod:`hicache.controller.controller` for the
protocol): side streams and their ordering, per-layer load events, issuing merged ops,
completion, eviction of the full pools, and the checks and moves of index tensors.

Thread ownership: one thread (the engine's scheduler) calls everything here, except
``wait_until``, which only reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, IndexSpace, Indices, PageAllocator
from hicache.pools.arg_checks import check_int

from .base import Ack, Direction, MovedTransfer, PoolTransfer, TransferBackend, TransferOp
from .events import Event, LayerEventRing
from .index_moves import move_checked, move_op_indices
from .op_issue import OpIssue
from .op_queue import OpQueue, TransferObserver, TransferPages, acknowledgement
from .side_streams import SideStreams
from .slot_checks import SlotChecks
from .stats import TransferStats


class TransferCore(OpIssue):
    """What every controller shares. :class:`CacheController` adds the write and load of
    one full-attention pool pair, ``HybridCacheController`` those of full plus SWA pools
    (their ``write``/``load`` differ, so neither overrides the other's).

    Args:
        device_pool: the device KV pool (``DEVICE_FULL``).
        device_allocator: allocator of ``device_pool``'s slots.
        host_pool: the pinned host pool (``HOST_FULL``), with its own allocator.
        backend: how rows cross (see ``controller.backends``); must serve the pools' device
            (``TransferBackend.check_device``), else ``ValueError`` here.
        producer_streams: streams that write KV (the engine's forward stream); writes and
            loads wait on all of them. More can be added with :meth:`register_producer_stream`.
        event_ring_size: per-layer event sets for loads (>= 2).
        full_layers: model layer ids stored in ``device_pool`` (default: all of them).
        num_model_layers: layers of the model (default: ``len(full_layers)``); one load
            event fires per model layer.
    """

    def __init__(
        self,
        *,
        device_pool: DeviceKVPool,
        device_allocator: PageAllocator,
        host_pool: HostKVPool,
        backend: TransferBackend,
        producer_streams: Sequence[torch.cuda.Stream] = (),
        event_ring_size: int = 3,
        full_layers: Sequence[int] | None = None,
        num_model_layers: int | None = None,
    ) -> None:
        self.device_pool = device_pool
        self.device_allocator = device_allocator
        self.host_pool = host_pool
        self.backend = backend
        self.device = device_pool.device
        backend.check_device(self.device)
        # Model layer ids held by the full pools; a hybrid model adds its SWA layers.
        self.full_layers = tuple(full_layers if full_layers is not None
                                 else range(device_pool.num_layers))
        self.num_layers = num_model_layers if num_model_layers is not None else len(
            self.full_layers)
        self.stats = TransferStats()
        self._streams = SideStreams(self.device, producer_streams)
        self.write_stream = self._streams.write_stream
        self.load_stream = self._streams.load_stream
        self.layer_events = LayerEventRing(event_ring_size, self.num_layers, self.device)
        self._ops = OpQueue(self._paged_pools())
        self._held = self._ops.held
        self._queued = self._ops.queued
        self._checks = SlotChecks(self._held)
        # poll() reads every device pool's bounds records: the list is fixed, find it once
        self._bounds_checks = tuple(pool.raise_if_tripped for pool in self._pools()
                                    if isinstance(pool, DeviceKVPool))

    # ---- configuration ------------------------------------------------------------------

    def register_producer_stream(self, stream: torch.cuda.Stream) -> None:
        """Add a stream that writes KV; every later write and load waits on it."""
        self._streams.register_producer(stream)

    def add_observer(self, observer: TransferObserver) -> None:
        """Call ``observer(direction, transfers, tag)`` for every call queued from now on
        (``write``, ``load`` and the hybrid controller's), on the scheduler thread once its
        slots are allocated, before the op is issued: ``transfers`` are its
        :class:`PoolTransfer` s (one per pool, aligned slots). For audits, tracing and
        tests; an observer's exception un-queues the call, frees its slots, reaches the caller."""
        self._ops.observers.append(observer)

    def remove_observer(self, observer: TransferObserver) -> None:
        """Stop calling ``observer`` (``ValueError`` if it was not added)."""
        self._ops.observers.remove(observer)

    def mark_caller(self) -> Event | None:
        """An event recorded now on the caller's current stream (``None`` on a CPU) for a
        later ``write`` of rows that stream writes, called with another stream current
        (the tree's backups, queued at insert and written at the step): its ``marks``."""
        marks = self._streams.mark_caller()
        return marks[0] if marks else None

    # ---- issuing (start_writing, start_loading, start_transfers: :mod:`.op_issue`) --------

    def wait_until(self, layer: int) -> None:
        """Make the caller's current stream wait until ``layer`` of the latest load is in
        place. A GPU-side wait: the CPU is not blocked. No-op when nothing was loaded.

        Safe from any thread without the service lock: it only reads. It raises rather than
        start queued loads: issued from a pool accessor, a transfer would run unlocked. O(1).

        Raises:
            RuntimeError: loads are queued but not started (their rows are not there yet).
            ValueError: ``layer`` is not a model layer (once a load exists).
        """
        if self._queued[Direction.HOST_TO_DEVICE]:  # per layer of every forward: no call
            raise RuntimeError(
                f"layer {layer} is read while {len(self._queued[Direction.HOST_TO_DEVICE])} "
                f"queued load(s) have not been started; call start_loading() "
                f"(service.start_loading()) before the forward that reads them")
        self.layer_events.wait_until(layer)

    def set_consumer(self, event_set: int | None) -> None:
        """Select which load batch :meth:`wait_until` waits on (overlap scheduling):
        ``None`` or a set of the ring, ``0 .. event_ring_size - 1``.

        Raises:
            TypeError, ValueError: anything else (a negative set would alias the last)."""
        if event_set is not None:
            event_set = check_int(event_set, "event_set", "set_consumer")
            if not 0 <= event_set < self.layer_events.num_sets:
                raise ValueError(f"set_consumer: event_set must be None or in 0.."
                                 f"{self.layer_events.num_sets - 1}, got {event_set}")
        self.layer_events.consumer = event_set

    # ---- completion ---------------------------------------------------------------------

    def poll(self) -> list[Ack]:
        """Raise a pending bounds error of a device pool (:meth:`raise_if_tripped`), then
        acknowledge finished ops (:meth:`poll_acks`)."""
        self.raise_if_tripped()
        return self.poll_acks()

    def poll_acks(self) -> list[Ack]:
        """Acknowledge finished ops, FIFO per direction, using ``query()`` only; never
        raises a pool's bounds error (for a background poller). Acknowledging releases the
        op's tensors, its in-flight protection and (for loads) its event set."""
        return [self._acknowledge(op) for op in self._ops.pop_done()]

    def raise_if_tripped(self) -> None:
        """Raise :class:`~hicache.pools.BoundsError` for the oldest CUDA bounds check of a
        device pool that the GPU has run and that found an index out of range (each is
        reported once; the offending rows went to the padding slot). Reads pinned host
        memory only: no synchronisation."""
        for raise_if_tripped in self._bounds_checks:
            raise_if_tripped()

    def drain(self) -> list[Ack]:
        """Shutdown: issue everything queued, block until it finished, acknowledge it all."""
        self.start_writing()
        self.start_loading()
        for direction in Direction:
            for op in self._ops.in_flight(direction):
                assert op.finish_event is not None
                op.finish_event.synchronize()
        acks = self.poll_acks()
        assert self._ops.num_ops == 0, "drain left ops in flight"
        return acks

    def finish_writes(self) -> None:
        """Issue queued writes and block until every write in flight has finished (their
        acks come with the next :meth:`poll`); loads are left alone."""
        self.start_writing()
        for op in self._ops.in_flight(Direction.DEVICE_TO_HOST):
            assert op.finish_event is not None
            op.finish_event.synchronize()

    @property
    def num_in_flight(self) -> int:
        """Ops queued or issued and not yet acknowledged."""
        return self._ops.num_ops

    @property
    def has_queued_writes(self) -> bool:
        """Writes queued and not issued yet (:meth:`start_writing` issues them)."""
        return self._ops.num_queued(Direction.DEVICE_TO_HOST) > 0

    # ---- eviction -----------------------------------------------------------------------

    def evict_device(self, device_indices: Indices) -> None:
        """Free device slots. Raises ``ValueError`` if any is read or written by an op in
        flight (wait for its ack)."""
        allocator = self.device_allocator
        allocator.free_pages(self._checks.freeable(device_indices, allocator, "evict_device"))

    def evict_host(self, host_indices: Indices) -> None:
        """Free host slots. Raises ``ValueError`` if any belongs to an op in flight."""
        allocator = self.host_pool.allocator
        allocator.free_pages(self._checks.freeable(host_indices, allocator, "evict_host"))

    def is_in_flight(self, indices: Indices) -> bool:
        """True when any of ``indices`` (CPU, any space this controller has a pool in, values
        in ``[0, num_slots)``) belongs to a queued or issued op not yet acknowledged.
        Raises ``ValueError`` for another space or an out-of-range slot."""
        slots = self._checks.slots(indices, "is_in_flight")
        return bool(self._held.mask(indices.space, slots).any())

    def busy_slots(self, space: IndexSpace) -> np.ndarray:
        """Slots of ``space`` held by ops in flight (for integrity checks)."""
        return self._held.held_slots(space)

    # ---- index movement -----------------------------------------------------------------

    def move_indices(
        self, host_indices: Indices, device_indices: Indices,
        backend: TransferBackend | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Put a transfer's indices where the backend reads them.

        The one place that casts and moves index tensors: pairs touching the padding slot
        are dropped, the rest become int64, staged through pinned memory and copied with
        ``non_blocking=True`` to the devices ``backend.index_devices`` names. The caller
        (the op) records the results on the stream that reads them and keeps them alive.

        Args:
            host_indices: ``[n]`` CPU host-space indices.
            device_indices: ``[n]`` CPU device-space indices.
            backend: the backend that will read them (default: the controller's).
        Returns:
            (host index, device index) raw int64 tensors of equal length.
        """
        host_pool, device_pool, host, device = self._checks.pair(
            host_indices, device_indices, "move_indices")
        return move_checked(host, device, host_pool, device_pool, backend or self.backend)

    def move_op_indices(self, op: TransferOp) -> list[MovedTransfer]:
        """Move the indices of every pool transfer of ``op`` where its backend reads them
        (see :func:`~hicache.controller.index_moves.move_op_indices`)."""
        return move_op_indices(op)

    def _pools(self) -> list[DeviceKVPool | HostKVPool]:
        return [pool for pool, _ in self._paged_pools()]

    def _paged_pools(self) -> list[tuple[DeviceKVPool | HostKVPool, int]]:
        """Every pool with the page size of the allocator that hands its slots out."""
        return [(self.device_pool, self.device_allocator.page_size),
                (self.host_pool, self.host_pool.page_size)]

    def _full_transfer(self, host: Indices, device: Indices) -> PoolTransfer:
        return PoolTransfer(
            name=self.device_pool.name, host_pool=self.host_pool, device_pool=self.device_pool,
            host_indices=host, device_indices=device, layers=self.full_layers,
        )

    def _queue(self, direction: Direction, transfers: list[PoolTransfer], tag: object,
               pages: Sequence[TransferPages] | None = None, owned: bool = False,
               marks: Sequence[Event] = (), cancel: Callable[[], object] = bool,
               host_ascending: bool = False) -> None:
        after = self._streams.mark_caller(marks) if direction is Direction.DEVICE_TO_HOST else ()
        self._ops.queue(direction, transfers, tag, pages, owned, after, cancel, host_ascending)

    def _acknowledge(self, op: TransferOp) -> Ack:
        if op.event_set is not None:
            self.layer_events.release(op.event_set, op.event_ticket)
        ack = acknowledgement(op)
        self.stats.on_ack(ack)
        return ack
