"""An engine's own small copy issued while an op is in flight, timed: what a step's input
upload or its sampled tokens' copy back to the host would wait behind a load or a write.

The copy engine serves queued copies in order, and a copy-engine op issued as one stream's
queue of copies made such a copy wait for the whole op (76 ms behind a 32k-token load on an
H200). The backends now let the engine in between their big copies
(:mod:`hicache.controller.copy_turns`); this measures it. A copy of
:data:`ENGINE_COPY_BYTES` in the op's direction is issued on a stream of its own right
after the op is issued, and timed on the host clock from its issue until its stream's event
after it is seen to fire (GPU timestamps cannot time it: an event recorded on the copy's
stream, or on another idle stream, just before it was seen to be held up too, and fire
after the copy's end); the same copy with nothing in flight is the reference."""

from __future__ import annotations

import statistics
import time

import torch

from .timing import issue_batch, recorded
from .workload import Session

ENGINE_COPY_BYTES = 64 << 10  # a step's token ids and positions, or a batch's sampled ids
ENGINE_COPY_OPS = 3  # ops the median is over


class EngineCopy:
    """A pinned host and a device buffer of :data:`ENGINE_COPY_BYTES` and the copy's
    stream."""

    def __init__(self) -> None:
        self.host = torch.empty(ENGINE_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
        self.device = torch.empty(ENGINE_COPY_BYTES, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()

    def time_s(self, to_host: bool) -> float:
        """Issue the copy now and wait for it: host seconds from its issue to its end seen."""
        begin = time.perf_counter()
        with torch.cuda.stream(self.stream):
            if to_host:
                self.host.copy_(self.device, non_blocking=True)
            else:
                self.device.copy_(self.host, non_blocking=True)
            end = recorded(self.stream)
        end.synchronize()
        return time.perf_counter() - begin

    def alone_s(self, to_host: bool, repeats: int = ENGINE_COPY_OPS + 2) -> float:
        """Median seconds of the copy with nothing else in flight (the reference)."""
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            times.append(self.time_s(to_host))
        return statistics.median(times)

    def during_s(self, session: Session, load: bool, num_tokens: int,
                 repeats: int = ENGINE_COPY_OPS) -> float:
        """Median seconds of the copy (in the op's direction) issued right after one op of
        ``num_tokens`` (a layer-wise load or a write), each op waited for and released."""
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            issued = issue_batch(session, load, 1, num_tokens)
            times.append(self.time_s(to_host=not load))
            session.finish(issued)
        return statistics.median(times)
