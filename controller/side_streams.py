"""The controller's side streams: where merged ops are issued and how they are ordered.

Stream rules (DESIGN section 4): before a write the write stream waits on an event recorded
on every registered producer stream and on the caller's stream; before a load the load
stream does the same, so loads into reused slots never race the forward pass. A write also
waits on the stream that was current where each of its calls was queued (:meth:`SideStreams.
mark_caller`): a backup queued by ``insert`` and issued at a later ``step()`` reads the rows
the inserting caller's stream wrote, whichever stream is current at the step. Every tensor
a side stream reads (moved indices and temporaries) is recorded on that stream and held by
its op until the op is acknowledged, and also when the op's issue raised half way (the
copies issued before still read them). On a CPU device there are no streams: copies run at
once, in order.

A layer-wise load is issued in groups of consecutive layers (:mod:`.load_groups`): one copy
per group and pool transfer, every layer's event recorded after its group. Through the
``kernel`` backend it is layer 0 and then one launch per pool of the rest, each counting its
layers' rows in place (:mod:`.layer_counters`), so each layer is still ready on its own: two
launches for one pool holding every layer, three for a hybrid model's full and SWA pools.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from .base import MovedTransfer, TransferBackend, TransferOp
from .events import CurrentStreams, Event
from .index_moves import record_on_stream
from .layer_counters import LayerCounters, counters_enabled
from .load_groups import local_groups, plan_load_groups
from .stream_pool import cache_stream


class SideStreams:
    """The write and load streams of one device, and the producer streams they wait on.

    Args:
        device: the pools' device (``cpu``: no streams).
        producer_streams: streams that write KV (the engine's forward stream).
    """

    def __init__(self, device: torch.device, producer_streams: Sequence[torch.cuda.Stream]
                 ) -> None:
        self.device = device
        self.producers = list(producer_streams)
        self.on_cuda = device.type == "cuda"
        self.write_stream = cache_stream(device) if self.on_cuda else None
        self.load_stream = cache_stream(device) if self.on_cuda else None
        # Without CUDA a move is done when issued: every write shares one completed event
        # (no timing: ``elapsed_s`` is None on a CPU anyway), made once, not twice per op.
        self._done: Event | None = None
        if not self.on_cuda:
            self._done = Event(device)
            self._done.record()
        # mark_caller: events waited on already (free to record again), the caller's stream
        self._free_marks: list[Event] = []
        self._callers = CurrentStreams(device) if self.on_cuda else None
        # per pool's model layers: made by the first counted load of that pool
        self._layer_counters: dict[tuple[int, ...], LayerCounters] = {}

    def mark_caller(self, earlier: Sequence[Event] = ()) -> tuple[Event, ...]:
        """``earlier`` and an event recorded now on the caller's current stream, for an op
        queued now and issued later to wait on (``earlier`` alone on a CPU). The events come
        from a free list: one goes back once the op that waited on it was issued (a wait
        holds the record made before it, so recording the event again afterwards is
        safe)."""
        callers = self._callers
        if callers is None:
            return tuple(earlier)
        event = self._free_marks.pop() if self._free_marks else Event(self.device)
        event.record(callers.stream(callers.raw()))
        return (*earlier, event)

    def register_producer(self, stream: torch.cuda.Stream) -> None:
        """Add a stream that writes KV; every later op waits on it."""
        if all(stream != s for s in self.producers):
            self.producers.append(stream)

    def issue_write(self, op: TransferOp) -> None:
        """Copy every layer of every pool transfer of ``op`` on the write stream."""
        if self._done is not None:
            executor = op.executor
            assert executor is not None, f"op {op.op_id} has no backend"
            for moved in op.moved:
                executor.copy(moved, range(len(moved.source.layers)), op.direction,
                              op.keep_alive)
            op.start_event = op.finish_event = self._done
            return
        stream = self.write_stream
        self._begin(op, stream)
        try:
            with _on_stream(stream, self._callers):
                for moved in op.moved:
                    local = list(range(len(moved.source.layers)))
                    _executor(op).copy(moved, local, op.direction, op.keep_alive)
                op.finish_event = Event(self.device, timing=True)
                op.finish_event.record(stream)
        finally:  # also after a copy raised: the copies issued before it read these
            self._finish(op, stream, issued=op.finish_event is not None)

    def issue_load(self, op: TransferOp, events: Sequence[Event],
                   between: Callable[[], object] | None = None, cover_bytes: int = 0) -> None:
        """Copy ``op`` on the load stream in groups of consecutive model layers
        (:mod:`.load_groups`): one copy per group and pool, then the event of the group's last
        layer recorded and the others' set to follow it (one event per model layer; the
        layers of a group become ready together). A counted load (:meth:`_counters`) is two
        groups, layer 0 and the rest, the second's layers each ready on its own (one
        launch per pool). ``between``: called once the first groups holding at least
        ``cover_bytes`` (all of them if none do) are issued, with the caller's stream
        current again (another op's issue: ``start_transfers``); the other groups are
        issued after it, also when it raises."""
        executor = _executor(op)
        layer_bytes = sum(op.bytes_by_pool.values()) // len(events)
        counters = self._counters(op, len(events))
        if counters is not None:  # layer 0, then the rest counted in one launch per pool
            groups: tuple[range, ...] = (range(0, 1), range(1, len(events)))
        else:
            groups = plan_load_groups(len(events), layer_bytes, executor.cheap_copies,
                                      executor.copy_s)
        parts = [(moved, local_groups(moved.source.layers, groups)) for moved in op.moved]
        stream = self.load_stream
        self._begin(op, stream)
        try:
            if between is None:
                self._issue_groups(op, events, groups, range(len(groups)), parts, counters)
            else:
                split, covered = 1, len(groups[0]) * layer_bytes
                while split < len(groups) and covered < cover_bytes:
                    covered += len(groups[split]) * layer_bytes
                    split += 1
                self._issue_groups(op, events, groups, range(split), parts, counters)
                try:
                    between()
                finally:
                    self._issue_groups(op, events, groups, range(split, len(groups)), parts,
                                       counters)
            op.finish_event = events[-1]
        finally:  # also after a copy raised: the copies issued before it read these
            self._finish(op, stream, issued=op.finish_event is not None)

    def _issue_groups(self, op: TransferOp, events: Sequence[Event],
                      groups: tuple[range, ...], numbers: range,
                      parts: Sequence[tuple[MovedTransfer, tuple[tuple[int, ...], ...]]],
                      counters: dict[tuple[int, ...], LayerCounters] | None) -> None:
        """Issue the layer groups ``numbers`` of ``groups`` of load ``op`` on the load
        stream (see :meth:`issue_load`)."""
        executor, stream = _executor(op), self.load_stream
        with _on_stream(stream, self._callers):
            for number in numbers:
                group = groups[number]
                if counters is not None and number == 1:
                    self._issue_counted(op, events, group, parts, counters, stream)
                    continue
                for moved, local in parts:
                    if local[number]:
                        executor.copy(moved, local[number], op.direction, op.keep_alive)
                last = events[group[-1]]
                last.record(stream)
                for layer in group[:-1]:
                    events[layer].follow(last)  # ready with the group: one record a group

    def _counters(self, op: TransferOp, num_layers: int
                  ) -> dict[tuple[int, ...], LayerCounters] | None:
        """The load stream's layer counters of each pool ``op`` loads, when it loads layer 0
        and then the rest counted, one launch per pool (:mod:`.layer_counters`): a backend
        that counts layers, on CUDA with the driver's wait on a value, pool transfers that
        hold every model layer once between them, each in ascending order (one pool of all
        layers, or a hybrid model's full and SWA pools), three layers or more; ``None``
        otherwise (layer groups)."""
        if (num_layers < 3 or not _executor(op).counts_layers or self.load_stream is None
                or not counters_enabled()
                or not _cover_once(tuple(moved.source.layers for moved in op.moved),
                                   num_layers)):
            return None
        found = self._layer_counters
        for moved in op.moved:
            layers = moved.source.layers
            if layers not in found:  # made on the caller's stream; the load stream waits on it
                found[layers] = LayerCounters(len(layers), self.load_stream.device)
        # never replaced: a launch in flight may still count into them, a stream wait on them
        return found

    @staticmethod
    def _issue_counted(op: TransferOp, events: Sequence[Event], layers: range,
                       parts: Sequence[tuple[MovedTransfer, tuple[tuple[int, ...], ...]]],
                       counters: dict[tuple[int, ...], LayerCounters],
                       stream: torch.cuda.Stream | None) -> None:
        """Load model ``layers`` (group 1 of ``parts``' local groups) in one counted launch per
        pool; the last layer's event is recorded after them all, the others fire as their
        counters reach their launch's count."""
        executor = _executor(op)
        launched = []
        try:
            for moved, local in parts:
                mine = local[1]
                if mine:  # consecutive local layers: the pool's layers ascend
                    pool_counters = counters[moved.source.layers]
                    local_range = range(mine[0], mine[-1] + 1)
                    per_layer = executor.copy_counted(moved, local_range, pool_counters.tensor)
                    launched.append((moved.source.layers, local_range, pool_counters,
                                     per_layer))
        except BaseException:
            # a launch may have gone before the error (another pool's, or this one's just
            # before a Ctrl-C): what the CPU expects of the counters must follow the GPU
            for moved, local in parts:
                if local[1]:
                    counters[moved.source.layers].resync(stream)
            raise
        last = events[layers[-1]]
        last.record(stream)
        for model_layers, local_range, pool_counters, per_layer in launched:
            # every counter grows, the last layer's too (its event is the record above)
            targets = pool_counters.issued(local_range, per_layer)
            for local_layer, (address, value) in zip(local_range, targets, strict=True):
                layer = model_layers[local_layer]
                if layer != layers[-1]:
                    events[layer].count(address, value, last)

    def _begin(self, op: TransferOp, side_stream: torch.cuda.Stream | None) -> None:
        """Order the side stream after every producer and after the caller's stream (which
        issued the index copies of ``move_indices``). Must run before the side stream is made
        current: inside it, "the current stream" would be the side stream itself. The
        events of these waits come from the free list of :meth:`mark_caller` and go back
        to it at once (held by this thread between its record and its wait)."""
        free = self._free_marks
        for stream in self.producers:
            event = free.pop() if free else Event(self.device)
            event.record(stream)
            event.wait(side_stream)
            free.append(event)
        # the streams current where its calls were queued; calls queued together may share
        # one event, which goes back to the free list once, when the op is issued
        # (:meth:`_finish`): an op whose issue raises is queued again with its calls' marks
        for mark in {id(mark): mark for mark in op.after}.values():
            mark.wait(side_stream)
        callers = self._callers
        if side_stream is not None and callers is not None:
            raw = callers.raw()
            assert raw != side_stream.cuda_stream, "_begin must run on the caller's stream"
            event = free.pop() if free else Event(self.device)
            event.record(callers.stream(raw))
            event.wait(side_stream)
            free.append(event)
        op.start_event = Event(self.device, timing=True)
        op.start_event.record(side_stream)

    def _finish(self, op: TransferOp, side_stream: torch.cuda.Stream | None,
                issued: bool) -> None:
        """Record ``op``'s tensors on its side stream (also when its issue raised: the copies
        made before read them); once it is ``issued``, its marks are free again."""
        if side_stream is not None:
            record_on_stream(op, side_stream)
        if issued and op.after:
            self._free_marks.extend({id(mark): mark for mark in op.after}.values())
            op.after = []


@functools.lru_cache(maxsize=64)
def _cover_once(layer_sets: tuple[tuple[int, ...], ...], num_layers: int) -> bool:
    """True when ``layer_sets`` hold every layer below ``num_layers`` once between them,
    each set in ascending order."""
    return (all(list(layers) == sorted(layers) for layers in layer_sets)
            and sorted(layer for layers in layer_sets for layer in layers)
            == list(range(num_layers)))


def _executor(op: TransferOp) -> TransferBackend:
    assert op.executor is not None, f"op {op.op_id} has no backend"
    return op.executor


@contextmanager
def _on_stream(stream: torch.cuda.Stream | None, callers: CurrentStreams | None
               ) -> Iterator[None]:
    """``stream`` current inside, the caller's stream again after. With the side stream's
    device current (the usual case) the caller's stream comes from ``callers`` by its raw
    handle and the streams are set directly: ``torch.cuda.stream()`` looked the current
    stream up twice, 10-20 us of an op's issue on an H200 host. Another device current:
    ``torch.cuda.stream()``, which also switches the device."""
    if stream is None or callers is None:
        yield
        return
    if _GET_DEVICE() != callers.index:
        with torch.cuda.stream(stream):
            yield
        return
    previous = callers.current()
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)


# The current CUDA device: torch's own call behind torch.cuda.current_device(), without its
# initialisation check (CUDA is initialised: side streams exist)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
