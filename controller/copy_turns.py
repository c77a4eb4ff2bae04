"""Copy streams that take turns, so a big op never holds the copy engine against another
stream's copy.

The copy engine serves the copies queued on it in order, and it goes on with one stream's
queued copies for as long as that stream has more: a 32k-token load (4 GiB, 77 ms on an
H200's link) issued as copies on one stream made any copy that an engine issued meanwhile on
another stream (a step's input upload, sampled tokens back to the host) wait for the whole
load. Feeding the load's copies from the CPU a few at a time did not help; what does is a
copy that the GPU itself holds back: each copy of the op runs on the other of two streams
than the copy before it and waits on that copy's event, so at most one copy of the op is
queued on the engine, and when it finishes the engine takes whatever another stream queued
before the next one starts. Measured (H200, 4 GiB in chunks, an engine's 64 KiB copy 20 ms
in): one stream made it wait 50-57 ms at 16-128 MiB chunks; taking turns, 0.4-0.75 ms, at
54.4-55.2 GB/s against 54.8-55.3 on one stream (both directions alike).

A turn costs a gap on the link between two copies (a few microseconds: 3.5% of a 4 MiB
copy, about 1% of a 16 MiB one) and two event calls on the CPU, so only a copy of at least
:data:`TURN_BYTES` makes the next one wait: a small op's copies queue together as before (the
op itself is short).
"""

from __future__ import annotations

import torch

from .copy2d import Copy2D
from .events import Event
from .stream_pool import stream_beside

# A copy of at least this many bytes (0.3 ms on a 55 GB/s link) makes the op's next copy
# wait until it has finished, so another stream's copy never waits behind more than about
# one such copy (or batch, :data:`PIECE_BYTES`) and the smaller ones queued with it.
TURN_BYTES = 16 << 20


def copy_streams(side: torch.cuda.Stream | None) -> tuple[torch.cuda.Stream | None,
                                                          torch.cuda.Stream | None]:
    """Two new streams on ``side``'s device that take turns for its copies (``None``
    twice on a CPU)."""
    return stream_beside(side), stream_beside(side)


def takes_turns(previous_bytes: int) -> bool:
    """True when the copy after one of ``previous_bytes`` must wait until it has finished."""
    return previous_bytes >= TURN_BYTES


# A big block's copies go in batches of about this many bytes, each a turn; a copy bigger
# than a batch is cut by rows (all layers of a 32k-token run are one 2 GiB copy per component:
# one copy call would hold the engine for 40 ms whatever stream it took).
PIECE_BYTES = 32 << 20


def copy_batches(copies: list[Copy2D]) -> list[tuple[list[Copy2D], int]]:
    """``copies`` (2D copies: host offset, host pitch, device offset, device pitch, width,
    height) in batches of about :data:`PIECE_BYTES`, in order, with each batch's bytes: a
    copy of more is cut into copies of whole rows (at least one row each)."""
    batches: list[tuple[list[Copy2D], int]] = []
    batch: list[Copy2D] = []
    size = 0
    for copy in copies:
        host, host_pitch, device, device_pitch, width, height = copy
        rows = max(1, PIECE_BYTES // width if width else height)
        for first in range(0, height, rows):
            count = min(rows, height - first)
            batch.append(copy if count == height else (
                host + first * host_pitch, host_pitch, device + first * device_pitch,
                device_pitch, width, count))
            size += width * count
            if size >= PIECE_BYTES:
                batches.append((batch, size))
                batch, size = [], 0
    if batch:
        batches.append((batch, size))
    return batches


class CopyTurns:
    """The two copy streams of one side stream, for a backend that issues its copies itself
    (``direct``): each copy of at least :data:`TURN_BYTES` makes the next wait for it.

    Per call of the backend: :meth:`start` (both copy streams after the side stream's work
    so far), then per batch of copies (:func:`copy_batches`) :meth:`next` (the raw handle of
    its stream) and :meth:`end`, then :meth:`join` (the side stream after every copy: its
    events, "layer ready" and the op's last, come after them).

    Args:
        side: the side stream (a CUDA stream).
    """

    def __init__(self, side: torch.cuda.Stream) -> None:
        self.side = side
        streams = copy_streams(side)
        self.streams = (streams[0], streams[1])
        self.handles = tuple(stream.cuda_stream for stream in self.streams if stream)
        self._mark = Event(side.device)
        self._done = (Event(side.device), Event(side.device))
        self._pending = [False, False]
        self._next = 0
        self._previous_bytes = 0

    def start(self) -> None:
        """Order both copy streams after the side stream's work issued so far."""
        self._mark.record(self.side)
        for stream in self.streams:
            self._mark.wait(stream)

    def next(self, num_bytes: int) -> int:
        """The raw handle of the stream for the next copy, of ``num_bytes``; after the copy
        before it when that one was big (:func:`takes_turns`)."""
        number = self._next
        if takes_turns(self._previous_bytes):
            self._done[1 - number].wait(self.streams[number])
        self._previous_bytes = num_bytes
        return self.handles[number]

    def end(self) -> None:
        """The copy of :meth:`next` is issued: record it; the next takes the other stream."""
        number = self._next
        self._done[number].record(self.streams[number])
        self._pending[number] = True
        self._next = 1 - number

    def join(self) -> None:
        """Make the side stream wait for every copy issued since the last join."""
        for number in (0, 1):
            if self._pending[number]:
                self._done[number].wait(self.side)
                self._pending[number] = False
