"""``hicache bench scheduler``'s figure of the background thread: the latency of the
scheduler's calls with the service's thread off, then running, in the steady state of a
busy scheduler (see :func:`measure_thread_latency`)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from .scheduler import ChatWorkload, fill, make_service, serve, timed


def measure_thread_latency(size: int, repeats: int, seed: int) -> dict[str, list[float]]:
    """p99 of a 2k-token match and of a request's cycle (its write-through backup queued
    until the cycle's step) with the background thread off, then running (it runs its idle
    integrity check once the scheduler has made no call for 10 ms), each after ``WARM_S``
    of the same calls untimed: in the steady state of a busy scheduler, in which the
    thread, finding it busy at every wake, has backed off to its longest sleep."""
    service = make_service(capacity_tokens=2 * size + 65_536, interval_s=0.01)
    try:
        workload = ChatWorkload(seed)
        fill(service, workload, size)
        prompt = workload.next_prompt()[:2048]
        prompts: list[list[int]] = []

        def match() -> None:
            service.match(prompt)

        def cycle() -> None:
            serve(service, prompts.pop())

        def draw() -> None:  # before the clock: the workload's generator is not the cache's
            prompts.append(workload.next_prompt()[-2048:])

        gc.collect()  # the filling workload's young lists, walked once (see measure_tree)

        def phase(call: Callable[[], None], before: Callable[[], None] | None) -> list[float]:
            _busy(call, before, WARM_S)
            return timed(call, repeats, before=before)

        match_off, cycle_off = phase(match, None), phase(cycle, draw)
        service.start()
        match_on, cycle_on = phase(match, None), phase(cycle, draw)
        return {"2k match, background thread off (p99)": [_p99(match_off)],
                "2k match, background thread on (p99)": [_p99(match_on)],
                "2k match, background thread on (max)": [max(match_on)],
                "one request's cycle, background thread off (p99)": [_p99(cycle_off)],
                "one request's cycle, background thread on (p99)": [_p99(cycle_on)]}
    finally:
        service.stop()


WARM_S = 2.0
"""Untimed busy seconds before each phase of :func:`measure_thread_latency`: longer than
the thread's backoff takes to reach its longest sleep (1.27 s from a 10 ms check interval,
about 1 s from the 1 ms poll interval)."""


def _busy(call: Callable[[], object], before: Callable[[], object] | None,
          seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if before is not None:
            before()
        call()


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
