"""Timing on the GPU: the copy-engine ceiling, op batches through the controller, and the
slowdown of a concurrent matmul loop.

Every time comes from CUDA events (``hicache.controller.Event``): an op's own start and finish
events (``Event.elapsed_s``), or events on a common reference for work on several streams.
Nothing here runs without CUDA.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hicache.controller import Event

from .workload import Issued, Session

CUDA = torch.device("cuda")
# The loop runs this many matmuls (~0.14 s at 8192^3 on an H100) before a transfer is issued,
# so clocks and power have settled; the matmuls right next to the transfer's window are its
# baseline (drift over the loop cancels between the two sides).
WARMUP_MATMULS = 100
BASELINE_MATMULS = 20  # on each side of the window
# Enough for a transfer of ~0.3 s and within the GPU's launch queue (a longer loop would block
# the CPU while queueing); slower transfers are sampled over their first part.
MAX_COVER_MATMULS = 250


def timing_event() -> Event:
    return Event(CUDA, timing=True)


def recorded(stream: torch.cuda.Stream | None = None) -> Event:
    """A timing event recorded now on ``stream`` (the current stream if ``None``)."""
    event = timing_event()
    event.record(stream if stream is not None else torch.cuda.current_stream())
    return event


def elapsed(start: Event, end: Event) -> float:
    seconds = start.elapsed_s(end)
    assert seconds is not None, "elapsed time needs two recorded CUDA timing events"
    return seconds


@dataclass
class Window:
    """Work issued on side streams between ``start`` and ``finish``; ``done`` waits for it
    and releases what it holds."""

    start: Event
    finish: Event
    done: Callable[[], None] = lambda: None


def time_copy(copy: Callable[[], None], stream: torch.cuda.Stream, repeats: int) -> float:
    """Best (shortest) seconds of ``copy`` run on ``stream`` over ``repeats`` after two
    warm-ups: a ceiling is what the link can do, and one slow repeat (a clock or power
    transient) must not lower it below what the backends then reach."""
    times = []
    for i in range(repeats + 2):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            start = recorded(stream)
            copy()
            end = recorded(stream)
        end.synchronize()
        if i >= 2:
            times.append(elapsed(start, end))
    return min(times)


class CeilingBuffers:
    """Contiguous device and pinned host buffers of ``num_bytes`` for both directions."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.dev_src = torch.empty(num_bytes, dtype=torch.uint8, device=CUDA)
        self.dev_src.view(torch.int16).random_(0, 0x4000)
        self.dev_dst = torch.empty_like(self.dev_src)
        self.host_dst = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        self.host_src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        self.host_src.copy_(self.dev_src)
        self.d2h_stream, self.h2d_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def release(self) -> None:
        """Give the buffers' memory back (device memory to the driver)."""
        del self.dev_src, self.dev_dst, self.host_dst, self.host_src
        torch.cuda.empty_cache()

    def d2h(self) -> None:
        self.host_dst.copy_(self.dev_src, non_blocking=True)

    def h2d(self) -> None:
        self.dev_dst.copy_(self.host_src, non_blocking=True)

    def both_s(self, repeats: int) -> float:
        """Best wall seconds (see :func:`time_copy`) of a d2h and an h2d copy on two streams
        at once, from a common reference event to the later finish."""
        times = []
        for i in range(repeats + 2):
            torch.cuda.synchronize()
            ref = recorded()
            ends = []
            for stream, copy in ((self.d2h_stream, self.d2h), (self.h2d_stream, self.h2d)):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    copy()
                    ends.append(recorded(stream))
            torch.cuda.synchronize()
            if i >= 2:
                times.append(max(elapsed(ref, end) for end in ends))
        return min(times)

    def window(self, to_host: bool) -> Window:
        """Issue one copy (after the current stream) as a slowdown window."""
        stream = self.d2h_stream if to_host else self.h2d_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            start = recorded(stream)
            (self.d2h if to_host else self.h2d)()
            return Window(start, recorded(stream))


class MatmulLoop:
    """The model's stand-in: ``size`` x ``size`` bf16 matmuls on a "forward" stream."""

    def __init__(self, size: int) -> None:
        self.size = size
        gen = torch.Generator(device=CUDA).manual_seed(1)
        self.a = torch.randn(size, size, device=CUDA, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(size, size, device=CUDA, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.a)

    def step(self) -> None:
        torch.matmul(self.a, self.b, out=self.out)

    def alone_s(self, stream: torch.cuda.Stream, count: int = 20, warmup: int = 2) -> float:
        """Median seconds of one matmul with nothing else running, after ``warmup``."""
        torch.cuda.synchronize()
        marks = self.run(stream, count + warmup)
        torch.cuda.synchronize()
        spans = [elapsed(a, b) for a, b in itertools.pairwise(marks)]
        return statistics.median(spans[warmup:])

    def run(self, stream: torch.cuda.Stream, count: int) -> list[Event]:
        """``count`` matmuls on ``stream``; events before the first and after each."""
        with torch.cuda.stream(stream):
            marks = [recorded(stream)]
            for _ in range(count):
                self.step()
                marks.append(recorded(stream))
        return marks


@dataclass
class Slowdown:
    """Median matmul time outside and inside a transfer window, and how many were inside."""

    alone_s: float
    during_s: float
    inside: int

    @property
    def pct(self) -> float:
        return 100.0 * (self.during_s / self.alone_s - 1.0)


def matmul_slowdown(loop: MatmulLoop, issue: Callable[[], Window],
                    expected_s: float) -> Slowdown | None:
    """Queue a matmul loop on a fresh forward stream, ``issue`` a transfer once the loop's
    first ``WARMUP_MATMULS`` are done (the GPU never idles: the rest is already queued), and
    compare the matmuls wholly inside the transfer's window with the ``BASELINE_MATMULS``
    just before and just after it. The forward stream is no producer of the controller, so
    the transfer does not wait for the loop. ``None`` when no matmul fell inside the window."""
    forward = torch.cuda.Stream()
    torch.cuda.synchronize()
    pace = loop.alone_s(forward, count=4)
    cover = min(MAX_COVER_MATMULS, math.ceil(1.3 * expected_s / pace) + 2)
    marks = loop.run(forward, WARMUP_MATMULS + cover + BASELINE_MATMULS)
    marks[WARMUP_MATMULS].synchronize()
    window = issue()
    torch.cuda.synchronize()
    window.done()
    begin, end = elapsed(marks[0], window.start), elapsed(marks[0], window.finish)
    inside, baseline = split_spans([elapsed(marks[0], mark) for mark in marks], begin, end)
    if not inside or not baseline:
        return None
    return Slowdown(statistics.median(baseline), statistics.median(inside), len(inside))


def median_slowdown(loop: MatmulLoop, issue: Callable[[], Window], expected_s: float,
                    windows: int) -> Slowdown | None:
    """:func:`matmul_slowdown` over ``windows`` separate transfer windows; the one with the
    median percentage. The GPU's clocks drift by several percent between windows under power
    limits, so one window alone is good only to about +-5 points."""
    found = [s for s in (matmul_slowdown(loop, issue, expected_s) for _ in range(windows))
             if s is not None]
    if not found:
        return None
    return sorted(found, key=lambda s: s.pct)[len(found) // 2]


def split_spans(times: list[float], begin: float,
                end: float) -> tuple[list[float], list[float]]:
    """Durations of the matmuls between consecutive ``times`` that lie wholly inside
    ``[begin, end]``, and of the ``BASELINE_MATMULS`` just before and just after it."""
    spans = list(itertools.pairwise(times))
    inside = [t1 - t0 for t0, t1 in spans if t0 >= begin and t1 <= end]
    before = [t1 - t0 for t0, t1 in spans if t1 <= begin][-BASELINE_MATMULS:]
    after = [t1 - t0 for t0, t1 in spans if t0 >= end][:BASELINE_MATMULS]
    return inside, before + after


@dataclass
class OpTimes:
    """Per-op seconds of a series of batches (start to finish event; loads also to layer 0),
    host-clock seconds per op to issue it and to issue and wait for it, and the backends
    that ran. An issue time close to the op time means the CPU, not the link, is the limit."""

    seconds: list[float] = field(default_factory=list)
    layer0_s: list[float] = field(default_factory=list)
    issue_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    executed_by: set[str] = field(default_factory=set)

    def add(self, issued: list[Issued], issue_s: float, wall_s: float, load: bool) -> None:
        for item in issued:
            op = item.op
            assert op.start_event is not None and op.finish_event is not None
            self.seconds.append(elapsed(op.start_event, op.finish_event))
            if load:
                self.layer0_s.append(elapsed(op.start_event, op.layer_events[0]))
            self.executed_by.add(op.backend)
        self.issue_s.append(issue_s / len(issued))
        self.wall_s.append(wall_s / len(issued))


def issue_batch(session: Session, load: bool, count: int, num_tokens: int) -> list[Issued]:
    if load:
        return session.load_ops(count, num_tokens)
    return session.write_ops(count, num_tokens)


def run_batches(session: Session, load: bool, count: int, num_tokens: int, repeats: int,
                times: OpTimes) -> None:
    """``repeats`` batches of ``count`` back-to-back ops, each waited for and released."""
    for _ in range(repeats):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        issued = issue_batch(session, load, count, num_tokens)
        issue = time.perf_counter() - begin
        session.finish(issued, keep=True)
        wall = time.perf_counter() - begin
        times.add(issued, issue, wall, load)
        session.finish(issued)


def batch_window(session: Session, load: bool, count: int, num_tokens: int) -> Window:
    """Issue a batch as a slowdown window; ``done`` acknowledges it and frees its slots."""
    issued = issue_batch(session, load, count, num_tokens)
    first, last = issued[0].op, issued[-1].op
    assert first.start_event is not None and last.finish_event is not None
    return Window(first.start_event, last.finish_event, lambda: session.finish(issued))
