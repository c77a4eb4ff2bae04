"""The cache controller: asynchronous, stream-safe page moves between host and device pools.

Protocol (names in call order)::

    write(device_indices)  -> host indices or None   queue a device-to-host op
    start_writing()                                   merge queued writes, issue on the write stream
    load(host_indices)     -> device indices or None  queue a host-to-device op
    start_loading()        -> event set id or None    issue layer by layer on the load stream
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

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from hicache.pools import (
    DeviceKVPool,
    HostKVPool,
    IndexSpace,
    Indices,
    PageAllocator,
    check_indices,
)

from .base import Ack, Direction, MovedTransfer, PoolTransfer, TransferBackend, TransferOp
from .events import Event, LayerEventRing
from .inflight import InFlightSlots
from .stats import TransferStats

logger = logging.getLogger(__name__)
CPU = torch.device("cpu")
# (direction, the queued call's pool transfers, its tag): see CacheController.add_observer
TransferObserver = Callable[[Direction, Sequence[PoolTransfer], object], None]

class CacheController:
    """Moves pages of one full-attention pool pair.

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
        self._producer_streams = list(producer_streams)
        on_cuda = self.device.type == "cuda"
        self.write_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.load_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.layer_events = LayerEventRing(event_ring_size, self.num_layers, self.device)
        self._op_ids = itertools.count()
        self._queued: dict[Direction, list[TransferOp]] = {d: [] for d in Direction}
        self._in_flight: dict[Direction, deque[TransferOp]] = {d: deque() for d in Direction}
        self._held = InFlightSlots(self._pools())
        self._observers: list[TransferObserver] = []

    # ---- configuration ------------------------------------------------------------------

    def register_producer_stream(self, stream: torch.cuda.Stream) -> None:
        """Add a stream that writes KV; every later write and load waits on it."""
        if all(stream != s for s in self._producer_streams):
            self._producer_streams.append(stream)

    def add_observer(self, observer: TransferObserver) -> None:
        """Call ``observer(direction, transfers, tag)`` for every call queued from now on
        (``write``, ``load`` and the hybrid controller's calls), on the scheduler thread
        right after the call's slots were allocated and before the op is issued:
        ``transfers`` are its :class:`PoolTransfer` s (one per pool, aligned host and
        device slots; a pool may have none). For audits, tracing and tests; an exception
        in an observer propagates to the caller of the queuing call, after the op was
        queued."""
        self._observers.append(observer)

    def remove_observer(self, observer: TransferObserver) -> None:
        """Stop calling ``observer`` (``ValueError`` if it was not added)."""
        self._observers.remove(observer)

    # ---- write path ---------------------------------------------------------------------

    def write(self, device_indices: Indices, tag: object = None) -> Indices | None:
        """Allocate host slots for ``device_indices`` and queue a device-to-host op.

        Args:
            device_indices: ``[n]`` CPU ``DEVICE_FULL`` slots (whole pages) to back up.
            tag: returned in the op's :class:`Ack` (e.g. a tree node id).
        Returns:
            ``[n]`` CPU int64 ``HOST_FULL`` slots aligned with ``device_indices``, or
            ``None`` when the host pool is full (nothing queued). Empty in, empty out.
        Raises:
            ValueError: ``device_indices`` are not whole, distinct, allocated pages of the
                device pool, or a queued or in-flight op touches one of them (nothing is
                allocated or queued then).
        """
        self._check_writable(device_indices, "write")
        host = self.host_pool.allocator.try_alloc(len(device_indices))
        if host is None:
            return None
        if len(host):
            transfer = self._full_transfer(host, device_indices)
            self._queue(Direction.DEVICE_TO_HOST, [transfer], tag)
        return host

    def start_writing(self) -> None:
        """Merge queued writes into one all-layer op and issue it on the write stream."""
        op = self._merge(Direction.DEVICE_TO_HOST)
        if op is None:
            return
        self._begin(op, self.write_stream)
        with self._on_stream(self.write_stream):
            for moved in op.moved:
                local = list(range(len(moved.source.layers)))
                self._executor(op).copy(moved, local, op.direction, op.keep_alive)
            op.finish_event = Event(self.device, timing=True)
            op.finish_event.record(self.write_stream)
        self._finish_submit(op, self.write_stream)

    # ---- load path ----------------------------------------------------------------------

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
        self._check_loadable(host_indices, self.host_pool.allocator, "load")
        device = self.device_allocator.try_alloc(len(host_indices))
        if device is None:
            return None
        if len(device):
            transfer = self._full_transfer(host_indices, device)
            self._queue(Direction.HOST_TO_DEVICE, [transfer], tag)
        return device

    def start_loading(self) -> int | None:
        """Issue queued loads layer by layer on the load stream.

        Returns:
            the event set id now consumed by :meth:`wait_until`, or ``None`` when nothing
            was queued (then ``wait_until`` keeps its previous consumer).
        Raises:
            RuntimeError: the ring's next event set is still in flight.
        """
        if not self._queued[Direction.HOST_TO_DEVICE]:
            return None
        set_id, events = self.layer_events.acquire()
        op = self._merge(Direction.HOST_TO_DEVICE)
        assert op is not None
        op.event_set, op.layer_events = set_id, events
        self._begin(op, self.load_stream)
        with self._on_stream(self.load_stream):
            for layer in range(self.num_layers):
                for moved in op.moved:
                    local = moved.local_layers_of(layer)
                    if local:
                        self._executor(op).copy(moved, local, op.direction, op.keep_alive)
                events[layer].record(self.load_stream)
        op.finish_event = events[-1]
        self.layer_events.consumer = set_id
        self._finish_submit(op, self.load_stream)
        return set_id

    def wait_until(self, layer: int) -> None:
        """Make the caller's current stream wait until ``layer`` of the latest load is in
        place. A GPU-side wait: the CPU is not blocked. No-op when nothing was loaded.

        Safe from any thread without the service lock: it only reads. It raises rather than
        starting queued loads itself, because a transfer issued from inside a pool accessor
        would run unlocked on whatever thread reads and would hide the ordering bug. O(1).

        Raises:
            RuntimeError: loads are queued but not started (their rows are not there yet).
            ValueError: ``layer`` is not a model layer (once a load exists).
        """
        queued = self._queued[Direction.HOST_TO_DEVICE]
        if queued:
            raise RuntimeError(
                f"layer {layer} is read while {len(queued)} queued load(s) have not been "
                f"started; call start_loading() (service.start_loading()) before the forward "
                f"that reads them"
            )
        self.layer_events.wait_until(layer)

    def set_consumer(self, event_set: int | None) -> None:
        """Select which load batch :meth:`wait_until` waits on (overlap scheduling)."""
        self.layer_events.consumer = event_set

    # ---- completion ---------------------------------------------------------------------

    def poll(self) -> list[Ack]:
        """Raise a pending bounds error of a device pool (:meth:`raise_if_tripped`), then
        acknowledge finished ops (:meth:`poll_acks`)."""
        self.raise_if_tripped()
        return self.poll_acks()

    def poll_acks(self) -> list[Ack]:
        """Acknowledge finished ops, FIFO per direction, using ``query()`` only; never
        raises a pool's bounds error (for a background poller).

        Acknowledging releases the op's tensors, its in-flight protection and (for loads)
        its event set.
        """
        acks: list[Ack] = []
        for direction in Direction:
            queue = self._in_flight[direction]
            while queue and queue[0].is_done():
                acks.append(self._acknowledge(queue.popleft()))
        return acks

    def raise_if_tripped(self) -> None:
        """Raise :class:`~hicache.pools.BoundsError` for the oldest CUDA bounds check of a
        device pool that the GPU has run and that found an index out of range (each is
        reported once; the offending rows went to the padding slot). Reads pinned host
        memory only: no synchronisation."""
        for pool in self._pools():
            if isinstance(pool, DeviceKVPool):
                pool.raise_if_tripped()

    def drain(self) -> list[Ack]:
        """Shutdown: issue everything queued, block until it finished, acknowledge it all."""
        self.start_writing()
        self.start_loading()
        for queue in self._in_flight.values():
            for op in queue:
                assert op.finish_event is not None
                op.finish_event.synchronize()
        acks = self.poll_acks()
        assert not any(self._in_flight.values()), "drain left ops in flight"
        return acks

    def finish_writes(self) -> None:
        """Issue queued writes and block until every write in flight has finished (their
        acks come with the next :meth:`poll`); loads are left alone."""
        self.start_writing()
        for op in self._in_flight[Direction.DEVICE_TO_HOST]:
            assert op.finish_event is not None
            op.finish_event.synchronize()

    @property
    def num_in_flight(self) -> int:
        """Ops queued or issued and not yet acknowledged."""
        queued = sum(len(q) for q in self._queued.values())
        return queued + sum(len(q) for q in self._in_flight.values())

    # ---- eviction -----------------------------------------------------------------------

    def evict_device(self, device_indices: Indices) -> None:
        """Free device slots. Raises ``ValueError`` if any is read or written by an op in
        flight (wait for its ack)."""
        self._check_not_busy(device_indices, "evict_device")
        self.device_allocator.free(device_indices)

    def evict_host(self, host_indices: Indices) -> None:
        """Free host slots. Raises ``ValueError`` if any belongs to an op in flight."""
        self._check_not_busy(host_indices, "evict_host")
        self.host_pool.allocator.free(host_indices)

    def is_in_flight(self, indices: Indices) -> bool:
        """True when any of ``indices`` (CPU, any space this controller has a pool in, values
        in ``[0, num_slots)``) belongs to a queued or issued op not yet acknowledged.
        Raises ``ValueError`` for another space or an out-of-range slot."""
        slots = self._slots(indices, "is_in_flight")
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
        host_pool = self._pool(host_indices.space, "move_indices")
        device_pool = self._pool(device_indices.space, "move_indices")
        if not isinstance(host_pool, HostKVPool) or not isinstance(device_pool, DeviceKVPool):
            raise ValueError(
                f"move_indices: expected (host, device) indices, got spaces "
                f"({host_indices.space.name}, {device_indices.space.name})"
            )
        host = self._check_cpu(host_indices, host_pool, "move_indices")
        device = self._check_cpu(device_indices, device_pool, "move_indices")
        if host.numel() != device.numel():
            raise ValueError(
                f"move_indices: {host.numel()} host indices but {device.numel()} device indices"
            )
        return _move_checked(host, device, host_pool, device_pool, backend or self.backend)

    def move_op_indices(self, op: TransferOp) -> list[MovedTransfer]:
        """Move the indices of every pool transfer of ``op`` (its own list, so a pool kind
        added later is covered without touching call sites). The op's indices are the
        controller's own copies, checked when their call was queued, so they are not
        checked again here."""
        backend = op.executor or self.backend
        return [
            MovedTransfer(t, *_move_checked(t.host_indices.tensor, t.device_indices.tensor,
                                            t.host_pool, t.device_pool, backend))
            for t in op.transfers
        ]

    # ---- internals ----------------------------------------------------------------------

    def _pools(self) -> list[DeviceKVPool | HostKVPool]:
        return [self.device_pool, self.host_pool]

    def _pool(self, space: IndexSpace, op: str) -> DeviceKVPool | HostKVPool:
        return self._held.pool(space, op)

    def _full_transfer(self, host: Indices, device: Indices) -> PoolTransfer:
        return PoolTransfer(
            name=self.device_pool.name, host_pool=self.host_pool, device_pool=self.device_pool,
            host_indices=host, device_indices=device, layers=self.full_layers,
        )

    def _check_cpu(
        self, indices: Indices, pool: DeviceKVPool | HostKVPool, op: str
    ) -> torch.Tensor:
        return check_indices(
            indices, space=pool.space, pool_name=pool.name, num_slots=pool.num_slots,
            device=CPU, op=op,
        )

    def _slots(self, indices: Indices, op: str) -> np.ndarray:
        """Raw numpy slots of ``indices``: CPU, a space this controller has, every value in
        range (numpy would wrap a negative index around)."""
        if not isinstance(indices, Indices):
            raise TypeError(f"{op}: expected hicache.pools.Indices, got {type(indices).__name__}")
        return self._check_cpu(indices, self._pool(indices.space, op), op).numpy()

    def _check_writable(self, device_indices: Indices, op: str) -> None:
        """Device slots to back up: whole, distinct, allocated pages that no op holds."""
        slots = _owned_slots(device_indices, self.device_allocator, op,
                             "back up only device slots that are allocated and hold rows")
        self._held.refuse_conflicts(device_indices.space, slots, op, Direction.DEVICE_TO_HOST)

    def _check_loadable(self, host_indices: Indices, allocator: PageAllocator, op: str) -> None:
        """Host slots to load: whole, distinct, allocated pages that no write still fills."""
        slots = _owned_slots(host_indices, allocator, op,
                             "load only host slots that write() returned and were not evicted")
        self._held.refuse_conflicts(host_indices.space, slots, op, Direction.HOST_TO_DEVICE)

    def _queue(self, direction: Direction, transfers: list[PoolTransfer], tag: object) -> None:
        """Queue one call's transfers. The op keeps its own copies of the slots: a caller
        that changes its index tensors after the call (or the host slots it got back) cannot
        change what the op copies or unbalance the in-flight counts."""
        transfers = [_owned_copy(t) for t in transfers]
        op = TransferOp(next(self._op_ids), direction, transfers, [tag], held=list(transfers))
        self._held.add(op, +1)
        self._queued[direction].append(op)
        for observer in list(self._observers):
            observer(direction, transfers, tag)

    def _merge(self, direction: Direction) -> TransferOp | None:
        """One op from all queued ops of ``direction`` (indices concatenated per pool)."""
        queued, self._queued[direction] = self._queued[direction], []
        if not queued:
            return None
        merged = []
        for i, first in enumerate(queued[0].transfers):
            parts = [op.transfers[i] for op in queued]
            merged.append(PoolTransfer(
                name=first.name, host_pool=first.host_pool, device_pool=first.device_pool,
                host_indices=_cat([p.host_indices for p in parts]),
                device_indices=_cat([p.device_indices for p in parts]),
                layers=first.layers,
            ))
        tags = [tag for op in queued for tag in op.tags]
        executor = self.backend.select(direction, self.host_pool.layout, merged[0].num_tokens,
                                       layer_wise=direction is Direction.HOST_TO_DEVICE)
        op = TransferOp(next(self._op_ids), direction, merged, tags, backend=executor.name,
                        executor=executor, held=[t for part in queued for t in part.held])
        op.moved = self.move_op_indices(op)
        return op

    @staticmethod
    def _executor(op: TransferOp) -> TransferBackend:
        assert op.executor is not None, f"op {op.op_id} has no backend"
        return op.executor

    def _begin(self, op: TransferOp, side_stream: torch.cuda.Stream | None) -> None:
        """Order the side stream after every producer and after the caller's stream (which
        issued the index copies of ``move_indices``). Must run before the side stream is made
        current: inside it, "the current stream" would be the side stream itself."""
        for stream in self._producer_streams:
            event = Event(self.device)
            event.record(stream)
            event.wait(side_stream)
        if side_stream is not None:
            caller = torch.cuda.current_stream(self.device)
            assert caller != side_stream, "_begin must run on the caller's stream"
            side_stream.wait_stream(caller)
        op.start_event = Event(self.device, timing=True)
        op.start_event.record(side_stream)

    def _finish_submit(self, op: TransferOp, side_stream: torch.cuda.Stream | None) -> None:
        if side_stream is not None:
            _record_on_stream(op, side_stream)
        self._in_flight[op.direction].append(op)
        self.stats.on_submit(op)
        logger.debug(
            "issued %s op %d: %d tokens, %d pools, backend %s",
            op.direction.value, op.op_id, op.num_tokens, len(op.transfers), op.backend,
        )

    def _acknowledge(self, op: TransferOp) -> Ack:
        self._held.add(op, -1)
        if op.event_set is not None:
            self.layer_events.release(op.event_set)
        duration = (
            op.start_event.elapsed_s(op.finish_event)
            if op.start_event is not None and op.finish_event is not None else None
        )
        ack = Ack(
            op.op_id, op.direction, op.tags,
            {t.name: t.num_tokens for t in op.transfers},
            {t.name: t.size_bytes for t in op.transfers},
            duration, op.backend,
        )
        self.stats.on_ack(ack)
        op.moved.clear()
        op.keep_alive.clear()
        return ack

    def _check_not_busy(self, indices: Indices, op: str) -> None:
        slots = self._slots(indices, op)
        busy = slots[self._held.mask(indices.space, slots)]
        if busy.size:
            raise ValueError(
                f"{op}: slot {int(busy[0])} of pool '{self._pool(indices.space, op).name}' "
                f"belongs to a transfer in flight; evict it after poll() acknowledged that "
                f"transfer"
            )

    @contextmanager
    def _on_stream(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield


def _owned_slots(indices: Indices, allocator: PageAllocator, op: str, fix: str) -> np.ndarray:
    """Raw numpy slots of ``indices`` once they are whole, distinct pages of ``allocator``'s
    pool (space, range, page 0: ``PageAllocator.pages_of``) and every page is allocated."""
    slot = allocator.first_unallocated(indices, op=op)
    if slot is not None:
        raise ValueError(
            f"{op}: {allocator.space.name} slot {slot} of pool '{allocator.name}' is not "
            f"allocated (never allocated, or already freed); {fix}"
        )
    return indices.tensor.numpy()


def _owned_copy(transfer: PoolTransfer) -> PoolTransfer:
    host, device = transfer.host_indices, transfer.device_indices
    return PoolTransfer(
        name=transfer.name, host_pool=transfer.host_pool, device_pool=transfer.device_pool,
        host_indices=Indices(host.tensor.clone(), host.space),
        device_indices=Indices(device.tensor.clone(), device.space), layers=transfer.layers,
    )


def _cat(parts: list[Indices]) -> Indices:
    if len(parts) == 1:
        return parts[0]
    return Indices(torch.cat([p.tensor for p in parts]), parts[0].space)


def _move_checked(
    host: torch.Tensor, device: torch.Tensor, host_pool: HostKVPool, device_pool: DeviceKVPool,
    backend: TransferBackend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`CacheController.move_indices` past its checks: aligned, checked CPU index
    tensors of equal length. Pairs touching the padding slot are dropped (numpy on the
    CPU: a few torch calls on small tensors would cost more than the whole op's
    bookkeeping)."""
    host_np, device_np = host.numpy(), device.numpy()
    if host_np.size and not (host_np.all() and device_np.all()):
        keep = (host_np != 0) & (device_np != 0)
        host_np, device_np = host_np[keep], device_np[keep]
    host = torch.from_numpy(host_np.astype(np.int64))  # a copy: the op owns what it moves
    device = torch.from_numpy(device_np.astype(np.int64))
    host, device = backend.order_pairs(host, device)
    host_target, device_target = backend.index_devices(host_pool, device_pool)
    return _to_device(host, host_target), _to_device(device, device_target)


def _to_device(index: torch.Tensor, target: torch.device) -> torch.Tensor:
    if target.type == "cpu":
        return index
    return index.pin_memory().to(target, non_blocking=True)


def _record_on_stream(op: TransferOp, stream: torch.cuda.Stream) -> None:
    """``record_stream`` every CUDA tensor the op's side stream reads: each pool transfer's
    moved indices (iterating the op's own list) and every temporary."""
    tensors = [t for moved in op.moved for t in (moved.host_index, moved.device_index)]
    for tensor in tensors + op.keep_alive:
        if tensor.is_cuda:
            tensor.record_stream(stream)
