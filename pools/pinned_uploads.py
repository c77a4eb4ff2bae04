"""Index uploads through reused pinned host buffers.

A transfer op's index tensors, and a forward's new-token slots given on the CPU, reach the
GPU through pinned memory, so the copy is asynchronous and never waits for the work queued
on the caller's stream (a pageable copy does: 14 ms of a 32k-token load's issue, measured).
``tensor.pin_memory()`` did that through torch's caching host allocator, and inside the
controller on an H100 host it cost 1.8-2.7 ms of CPU for the 512 KiB of a 32k-token load's
two index tensors (40 us for the same call in a loop on its own); through a pinned buffer
kept from one upload to the next, 0.23-0.50 ms (an A/B on the same machine).

:class:`PinnedUploads` keeps a few pinned buffers, each with an event recorded after the
copy that read it; an upload takes the smallest idle buffer large enough (idle: its event
has fired), or pins a new one (sizes are powers of two, at least :data:`MIN_ELEMS`). Never
blocks: a buffer still being read is never written, and when all are busy a new one is
made. At most :data:`MAX_BUFFERS` are kept; a busy buffer beyond that is dropped once
replaced, which is safe: torch's host allocator keeps pinned memory that a copy reads alive
until the copy's stream passes it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from .current_streams import CurrentStreams
from .upload_kernel import upload_through_sms

MIN_ELEMS = 4096
MAX_BUFFERS = 8


class _Buffer:
    """One pinned int64 buffer, its numpy view, and the event after its last upload."""

    __slots__ = ("array", "event", "tensor")

    def __init__(self, num_elems: int) -> None:
        self.tensor = torch.empty(num_elems, dtype=torch.int64, pin_memory=True)
        self.array = self.tensor.numpy()
        self.event = torch.cuda.Event()  # never recorded: query() is True

    def idle(self) -> bool:
        return bool(self.event.query())


class PinnedUploads:
    """Uploads of int64 index arrays to a CUDA device, staged through reused pinned buffers.
    Thread-safe (one lock around the choice of a buffer)."""

    def __init__(self) -> None:
        self._buffers: list[_Buffer] = []
        self._lock = threading.Lock()
        self._streams: dict[int, CurrentStreams] = {}  # by device index

    def upload(self, parts: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
        """One int64 tensor on ``device`` holding ``parts`` one after another, copied on the
        current stream of ``device`` without blocking. ``parts``: 1-D integer arrays whose
        values fit int64."""
        count = sum(part.size for part in parts)
        buffer = self._take(count)
        at = 0
        for part in parts:
            buffer.array[at:at + part.size] = part
            at += part.size
        source = buffer.tensor[:count]
        # beyond a few KiB through the SMs, not the copy engine: a copy would wait for a
        # load's queued copies (:mod:`.upload_kernel`)
        on_device = upload_through_sms(source, device)
        if on_device is None:
            on_device = source.to(device, non_blocking=True)
        buffer.event.record(self._current_stream(device))
        with self._lock:
            self._buffers.append(buffer)
        return on_device

    def _current_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The current stream of ``device`` by its raw handle (:class:`CurrentStreams`):
        ``torch.cuda.current_stream(device)`` was a quarter of a small upload's CPU time."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        streams = self._streams.get(index)
        if streams is None:
            streams = self._streams[index] = CurrentStreams(torch.device("cuda", index))
        return streams.current()

    def pinned_bytes(self) -> int:
        """Pinned memory the kept buffers hold."""
        with self._lock:
            return sum(b.tensor.numel() * 8 for b in self._buffers)

    def _take(self, count: int) -> _Buffer:
        """The smallest idle kept buffer of at least ``count`` elements, removed from the
        kept list while in use; a new one when none is (the kept list is then cut to
        ``MAX_BUFFERS - 1``, oldest first, so the new one fits once it is kept)."""
        with self._lock:
            buffers = self._buffers
            best = None
            for at, buffer in enumerate(buffers):
                size = buffer.array.size
                if size >= count and (best is None or size < buffers[best].array.size) \
                        and buffer.idle():
                    best = at
            if best is not None:
                return buffers.pop(best)
            while len(buffers) >= MAX_BUFFERS:
                buffers.pop(0)
        return _Buffer(max(MIN_ELEMS, 1 << max(0, count - 1).bit_length()))


# One per process: the buffers serve every controller (uploads are short, and a buffer is
# reused only once its copy is done, whoever issued it).
UPLOADS = PinnedUploads()
