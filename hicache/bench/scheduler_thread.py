"""``hicache bench scheduler``'s figure of the background thread: the latency of the
scheduler's calls with the service's thread off and running, in turns, in the steady state of a
busy scheduler (see :func:`measure_thread_latency`)."""

from __future__ import annotations

import gc
import time

from hicache.service import HiCacheService

from .scheduler import ChatWorkload, capacity_for, fill, make_service, serve


def measure_thread_latency(size: int, repeats: int, seed: int) -> dict[str, list[float]]:
    """p99 of a 2k-token match and of a request's cycle (its write-through backup queued
    until the cycle's step) with the background thread off and running, in the steady
    state of a busy scheduler, in which the thread, finding it busy at every wake, has
    backed off to its longest sleep (``WARM_S`` of the same calls untimed first).

    Two services filled alike, one whose thread never starts and one whose thread runs,
    take the same calls in the same order, in turns of :data:`BLOCK_CALLS` calls: a drift
    of the host's speed, a garbage collection or a tree that earlier calls changed (a
    cycle's p99 is an eviction's or a collection's) then falls on both alike, and the
    difference is the thread's. A turn is shorter than the running service's idle check
    interval (10 ms), so its thread never finds it idle while the other takes its turn.

    About one cycle in a hundred is stopped by a collection of the garbage collector (a
    few hundred microseconds, the bench's own prompt lists included), so a cycle's p99
    sits at that edge and moves by tens of percent between runs; the p99 of the cycles no
    collection stopped is given beside it, for each side."""
    quiet, running = (make_service(capacity_tokens=capacity_for(size), interval_s=0.01)
                      for _ in range(2))
    try:
        sides = (_Side(quiet, seed, size), _Side(running, seed, size))
        gc.collect()  # the filling workloads' young lists, walked once (see measure_tree)
        running.start()
        gc.callbacks.append(_COLLECTIONS.count)
        match_off, match_on = _in_turns(sides, "match", repeats)
        cycle_off, cycle_on = _in_turns(sides, "cycle", repeats)
        out = {"2k match, background thread off (p99)": [p99(match_off)],
               "2k match, background thread on (p99)": [p99(match_on)],
               "2k match, background thread on (max)": [max(match_on)]}
        for name, calls in (("off", cycle_off), ("on", cycle_on)):
            out[f"one request's cycle, background thread {name} (p99)"] = [p99(calls)]
        for name, calls in (("off", cycle_off), ("on", cycle_on)):
            spared = [us for us, collected in zip(calls, calls.collected, strict=True)
                      if not collected]
            out[f"the same, thread {name}, calls no collection stopped (p99)"] = [p99(spared)]
        return out
    finally:
        if _COLLECTIONS.count in gc.callbacks:
            gc.callbacks.remove(_COLLECTIONS.count)
        quiet.stop()
        running.stop()


def _in_turns(sides: tuple[_Side, _Side], name: str, repeats: int
              ) -> tuple[_Calls, _Calls]:
    """Microseconds of ``repeats`` calls of ``name`` on each side, the sides taking turns
    of :data:`BLOCK_CALLS` calls, after ``WARM_S`` of turns untimed."""
    deadline = time.monotonic() + WARM_S
    while time.monotonic() < deadline:
        for side in sides:
            side.block(name, BLOCK_CALLS)
    times = (_Calls(), _Calls())
    while len(times[0]) < repeats:
        count = min(BLOCK_CALLS, repeats - len(times[0]))
        for side, out in zip(sides, times, strict=True):
            side.block(name, count, out)
    return times


class _Calls(list[float]):
    """Microseconds of calls, and whether a garbage collection ran during each."""

    def __init__(self) -> None:
        super().__init__()
        self.collected: list[bool] = []


class _Collections:
    """Counts the garbage collector's collections (a ``gc.callbacks`` entry)."""

    def __init__(self) -> None:
        self.done = 0

    def count(self, phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            self.done += 1


_COLLECTIONS = _Collections()


class _Side:
    """One service of :func:`measure_thread_latency` and its workload (seeded alike on
    both sides, so both see the same prompts in the same order)."""

    def __init__(self, service: HiCacheService, seed: int, size: int) -> None:
        self.service = service
        self.workload = ChatWorkload(seed)
        fill(service, self.workload, size)
        prompt = self.workload.next_prompt()
        while len(prompt) < 2048:  # a new conversation (1536 tokens): the 2k match needs a
            prompt = self.workload.next_prompt()  # later turn, cut to 2048 tokens
        self.prompt = prompt[:2048]
        self.prompts: list[list[int]] = []

    def block(self, name: str, calls: int, out: _Calls | None = None) -> None:
        """``calls`` calls of ``name`` (``match`` or ``cycle``), timed into ``out``."""
        call, before = (self._match, None) if name == "match" else (self._cycle, self._draw)
        for _ in range(calls):
            if before is not None:
                before()
            collections = _COLLECTIONS.done
            start = time.perf_counter_ns()
            call()
            elapsed = time.perf_counter_ns() - start
            if out is not None:
                out.append(elapsed / 1e3)
                out.collected.append(_COLLECTIONS.done != collections)

    def _match(self) -> None:
        self.service.match(self.prompt)

    def _cycle(self) -> None:
        serve(self.service, self.prompts.pop())

    def _draw(self) -> None:  # before the clock: the workload's generator is not the cache's
        self.prompts.append(self.workload.next_prompt()[-2048:])


WARM_S = 2.0
"""Untimed busy seconds before each figure of :func:`measure_thread_latency`: longer than
the thread's backoff takes to reach its longest sleep (1.27 s from a 10 ms check interval,
about 1 s from the 1 ms poll interval)."""

BLOCK_CALLS = 16
"""Calls of one side's turn: 16 cycles take 3-5 ms, under the 10 ms after which the running
service's thread would find it idle."""


def p99(values: list[float]) -> float:
    """The 99th percentile of ``values`` (their unit): the value at 99% of them, sorted."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
