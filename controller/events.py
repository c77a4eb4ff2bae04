"""Completion events and the ring of per-layer event sets.

On CUDA an :class:`Event` wraps ``torch.cuda.Event``. Without CUDA every move is synchronous,
so events are complete the moment they are recorded: the same protocol (record, query,
wait, FIFO polling, ring reuse) runs and is tested on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache.pools.arg_checks import check_int
from hicache.pools.current_streams import CurrentStreams

from .layer_counters import wait_value

# ``torch.cuda.Event``'s record and wait without its Python wrapper, which only looks up the
# current stream when none is given (a frame a call; a staged chunk makes four such calls);
# found when the first CUDA event is made (a CPU build's event type has neither)
_RECORD: Any = None
_WAIT: Any = None


def _find_event_calls() -> None:
    global _RECORD, _WAIT
    base = getattr(torch._C, "_CudaEventBase", None)
    _RECORD = getattr(base, "record", None) or torch.cuda.Event.record
    _WAIT = getattr(base, "wait", None) or torch.cuda.Event.wait


class Event:
    """A completion marker on a stream; ``query()`` never blocks.

    An event can also stand for another one (:meth:`follow`): the layers of one load group
    are ready when the group's copy is, so their events follow the group's last event
    instead of each being recorded (a record costs microseconds of CPU; a follow, an
    attribute).
    """

    def __init__(self, device: torch.device, timing: bool = False) -> None:
        self._cuda = (
            torch.cuda.Event(enable_timing=timing) if device.type == "cuda" else None
        )
        if self._cuda is not None and _RECORD is None:
            _find_event_calls()
        self.is_recorded = False
        self._leader: Event | None = None
        # (address, value): fired once the int32 counter at ``address`` reaches ``value``
        # (:meth:`count`); its leader answers the CPU's questions
        self._counter: tuple[int, int] | None = None
        # records so far: a wait on this event is one on its latest record only
        self.generation = 0
        # the generation a query found fired (waits on a finished load are skipped after it)
        self.fired_generation = -1

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        """Mark the current point of ``stream`` (the current stream if ``None``)."""
        self._leader = self._counter = None
        if self._cuda is not None:
            if stream is None:
                self._cuda.record()
            else:  # the event type's own call: torch's wrapper only finds a stream
                _RECORD(self._cuda, stream)
        self.is_recorded = True
        self.generation += 1

    def follow(self, leader: Event) -> None:
        """Fire with ``leader`` (a recorded event, not itself following one) until this
        event is recorded or follows another: ``query``, ``wait`` and ``synchronize`` are
        the leader's. Timing (``elapsed_s``) reads this event's own record."""
        assert leader._leader is None and leader is not self, "follow a recorded event"
        self._leader, self._counter = leader, None
        self.is_recorded = True
        self.generation += 1

    def count(self, address: int, value: int, leader: Event) -> None:
        """Fire when the int32 counter at device ``address`` reaches ``value``
        (:mod:`~hicache.controller.layer_counters`): a stream's :meth:`wait` waits on the
        counter. ``query`` and ``synchronize`` are those of ``leader``, a recorded event
        that fires after the counter reaches the value (the load's last event)."""
        self.follow(leader)
        self._counter = (address, value)

    def mark(self) -> tuple[Event, int]:
        """The recorded event this one stands for (itself or its leader) and that event's
        record count: two equal marks are one point of one stream."""
        source = self._leader if self._leader is not None else self
        return source, source.generation

    def query(self) -> bool:
        """True once all work before the record point has finished (or never recorded)."""
        if self._leader is not None:
            return self._leader.query()
        return self._cuda.query() if self._cuda is not None else True

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for this event on the GPU; no CPU block."""
        if self._counter is not None and self._cuda is not None:
            stream = torch.cuda.current_stream() if stream is None else stream
            if wait_value(stream.cuda_stream, *self._counter):
                return
        if self._leader is not None:
            self._leader.wait(stream)
        elif self._cuda is not None and self.is_recorded:
            if stream is None:
                self._cuda.wait()
            else:
                _WAIT(self._cuda, stream)

    def synchronize(self) -> None:
        """Block the CPU until the event fires. Shutdown and tests only."""
        if self._leader is not None:
            self._leader.synchronize()
        elif self._cuda is not None and self.is_recorded:
            self._cuda.synchronize()

    def elapsed_s(self, end: Event) -> float | None:
        """Seconds from this event to ``end`` (both timing events, both fired)."""
        if self._cuda is None or end._cuda is None:
            return None
        return float(self._cuda.elapsed_time(end._cuda)) / 1e3


class LayerEventRing:
    """A few sets of per-layer events, rotated per load batch.

    The next batch's load may start while the forward pass still consumes the previous
    one. Rotating onto a set whose last event has not fired is an error (the consumer might
    still wait on it), never a hang; with :attr:`wait_when_busy` (a tensor-parallel rank's,
    whose ranks must all take the set or all refuse, whatever each one's timing) the CPU
    waits for that event instead.
    """

    def __init__(self, num_sets: int, num_layers: int, device: torch.device) -> None:
        if num_sets < 2:
            raise ValueError(f"event ring needs at least 2 sets, got {num_sets}")
        self.num_layers = num_layers
        self._sets = [
            [Event(device, timing=(layer in (0, num_layers - 1))) for layer in range(num_layers)]
            for _ in range(num_sets)
        ]
        self._in_use = [False] * num_sets
        self._taken = [0] * num_sets  # times each set was handed out: whose load holds it
        self.num_sets = num_sets
        self._next = 0
        self.consumer: int | None = None
        self._waits = StreamWaits(device)
        self._asked: tuple[int, int, int] | None = None  # (set, its record, layer) queried
        self.wait_when_busy = False

    def acquire(self) -> tuple[int, list[Event]]:
        """Take the next set for a new load; raises if its previous load has not finished
        (waits for it with :attr:`wait_when_busy`)."""
        index = self._next
        events = self._sets[index]
        if self._in_use[index] and not events[-1].query():
            if self.wait_when_busy:
                events[-1].synchronize()
                return self._take(index, events)
            raise RuntimeError(
                f"layer event set {index} is still in flight: {len(self._sets)} load batches "
                f"are outstanding; poll() the controller before starting another load"
            )
        return self._take(index, events)

    def _take(self, index: int, events: list[Event]) -> tuple[int, list[Event]]:
        self._in_use[index] = True
        self._taken[index] += 1
        self._next = (index + 1) % len(self._sets)
        return index, events

    def taken(self, index: int) -> int:
        """How many times set ``index`` was handed out: right after :meth:`acquire`, the
        ticket its load releases it with."""
        return self._taken[index]

    def release(self, index: int, ticket: int) -> None:
        """The load that took set ``index`` as ``ticket`` is acknowledged. A set whose last
        event fired may be handed out again before that load's ack is polled: the older
        ack then leaves the newer load's hold alone."""
        if self._taken[index] == ticket:
            self._in_use[index] = False

    def wait_until(self, layer: int) -> None:
        """Make the current stream wait for ``layer`` of the consumer set (GPU-side); the
        layer is checked whether or not a load exists.

        Nothing is waited on once the set's load has finished: its last event (recorded
        after every layer's copies) fired, as a query found (:meth:`StreamWaits.load_done`,
        one query per layer asked while the load runs). A forward catches up with a small
        load within a few layers, and the pool's accessors ask three times a layer: each
        ask after that is two attribute reads, not a stream lookup and a wait."""
        if type(layer) is not int:
            layer = check_int(layer, "layer", "wait_until")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"wait_until: layer {layer} out of range (0..{self.num_layers - 1})")
        consumer = self.consumer
        if consumer is None:
            return
        events = self._sets[consumer]
        last = events[-1]
        generation = last.generation  # read before the query: a later record fires later
        if last.fired_generation == generation:
            return
        asked = (consumer, generation, layer)
        if asked != self._asked:  # the first ask of this layer: a query may find it done
            self._asked = asked
            if self._waits.load_done(last):
                return
        self._waits.wait(events[layer])


class StreamWaits:
    """Waits of the current stream on events, each made once per stream and record.

    A forward asks for one layer several times (``set_kv``, ``key_buffer``,
    ``value_buffer``) and the layers of a load group share one event; a stream that already
    waits on an event's latest record needs no second wait, because a wait holds for all
    later work of that stream. The current stream is found by its raw handle
    (:class:`CurrentStreams`): three lookups a layer.

    Safe from any thread: a mark is stored only after its wait was enqueued, so a thread
    that finds it enqueues its work after that wait.
    """

    def __init__(self, device: torch.device) -> None:
        self._current = CurrentStreams(device)
        self._raw_of = self._current.raw_of
        self._waited: dict[int, tuple[Event, int]] = {}  # raw handle -> last mark waited on

    def wait(self, event: Event) -> None:
        """Make the current stream wait for ``event`` (GPU-side; nothing on a CPU)."""
        # CurrentStreams.raw() and the event's mark inline (a counted event is its own):
        # this runs per layer of every forward
        counter = event._counter
        source = event if counter is not None or event._leader is None else event._leader
        cuda = source._cuda
        if cuda is None or not source.is_recorded:
            return
        raw = self._raw_of(self._current.index)
        waited = self._waited.get(raw)
        generation = source.generation
        if waited is not None and waited[0] is source and waited[1] == generation:
            return
        if counter is None:
            cuda.wait(self._current.stream(raw))
        elif not self.load_done(event._leader) and not wait_value(raw, *counter):
            leader = event._leader  # the driver refused: wait for the whole load
            assert leader is not None and leader._cuda is not None
            leader._cuda.wait(self._current.stream(raw))
        self._waited[raw] = (source, generation)

    @staticmethod
    def load_done(last: Event | None) -> bool:
        """True when a load's ``last`` event (recorded, not following another) has fired:
        a query finds it once per record, an attribute read after. Waits on a finished load
        are skipped: a counted layer's driver wait (about 3 us a call on an H200 host), and
        from :meth:`LayerEventRing.wait_until` every wait."""
        assert last is not None, "a counted event has its load's last event as leader"
        generation = last.generation  # read before the query: a later record fires later
        if last.fired_generation == generation:
            return True
        if last.query():
            last.fired_generation = generation
            return True
        return False
