"""``hicache bench scheduler``: what hicache costs the engine's scheduler thread, on a CPU.

Every figure is a call an engine makes between GPU steps, timed one call at a time
(``time.perf_counter_ns``) through the real service over CPU pools of a tiny row geometry
(so the copies of a CPU "transfer" are a few bytes and bookkeeping dominates), at trees of
several sizes (tokens cached on the device). Reported per figure: min, median and max over
the repeats, and the log-log slope of the median against the tree size (0: flat; 1: linear).

The workload is chat-like: system prompts of ``SYSTEM_TOKENS`` shared by conversations whose
turns extend their history, cut into whole pages, inserted until the tree holds the target.
A request's cycle and an insert are timed on requests of ``REQUEST_TOKENS``: a system prompt
the tree caches and new tokens (:meth:`ChatWorkload.request`), as in the end-to-end figure.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch

from hicache.config import config_from_dict
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices
from hicache.radix import MatchResult, TokenKey
from hicache.service import HiCacheService

PAGE = 16
SYSTEM_TOKENS = 1024
REQUEST_TOKENS = 2048  # the cycle's, the insert's and the end-to-end figure's requests
TURN_TOKENS = 512
VOCAB = 50_000


@dataclasses.dataclass
class Figure:
    """One row of the table: a call and its per-size timings (microseconds)."""

    name: str
    target_us: float | None
    by_size: dict[int, list[float]] = dataclasses.field(default_factory=dict)

    def summary(self, size: int) -> tuple[float, float, float]:
        values = self.by_size[size]
        return min(values), statistics.median(values), max(values)

    def slope(self) -> float | None:
        """Log-log slope of the median against the tree size (``None`` for one size)."""
        sizes = sorted(self.by_size)
        if len(sizes) < 2:
            return None
        medians = [max(self.summary(s)[1], 1e-3) for s in sizes]
        return math.log(medians[-1] / medians[0]) / math.log(sizes[-1] / sizes[0])


def capacity_for(size: int) -> int:
    """The device pool of a tree of ``size`` cached tokens: twice the tree and room for the
    requests timed on it, in whole pages."""
    return -(-(2 * size + 65_536) // PAGE) * PAGE


def make_service(capacity_tokens: int, host_ratio: float = 1.0, interval_s: float = 3600.0,
                 page_size: int = PAGE) -> HiCacheService:
    """A plain CPU service, one layer of 2-element rows, write-through; the background
    thread (when started) checks integrity every ``interval_s`` while idle."""
    return build_service(config_from_dict(
        service_config(capacity_tokens, host_ratio, interval_s, page_size)))


def service_config(capacity_tokens: int, host_ratio: float = 1.0, interval_s: float = 3600.0,
                   page_size: int = PAGE) -> dict[str, Any]:
    """:func:`make_service`'s config, as a mapping."""
    return {
        "page_size_tokens": page_size,
        "model": {"num_layers": 1, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": capacity_tokens, "device": "cpu"},
        "host": {"ratio": host_ratio, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": interval_s},
    }


class ChatWorkload:
    """Deterministic chat prompts: ``num_systems`` system prompts, conversations growing by
    ``TURN_TOKENS`` a turn."""

    def __init__(self, seed: int, num_systems: int = 1000) -> None:
        self.rng = random.Random(seed)
        self.systems = [self._tokens(SYSTEM_TOKENS) for _ in range(num_systems)]
        self.histories: list[list[int]] = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def next_prompt(self) -> list[int]:
        """A new conversation (40%) or the next turn of an earlier one."""
        if not self.histories or self.rng.random() < 0.4:
            history = list(self.rng.choice(self.systems))
            self.histories.append(history)
        else:
            history = self.rng.choice(self.histories)
        history += self._tokens(TURN_TOKENS)
        return list(history)

    def request(self, systems: list[list[int]]) -> list[int]:
        """A ``REQUEST_TOKENS``-token request with a shared prefix: one of ``systems`` (the
        system prompts the tree caches) followed by new tokens, as a chat's new
        conversation reaches the engine."""
        return self.rng.choice(systems) + self._tokens(REQUEST_TOKENS - SYSTEM_TOKENS)

    def cached_systems(self, service: HiCacheService) -> list[list[int]]:
        """The system prompts ``service`` caches on the device in full."""
        cached = [system for system in self.systems
                  if service.match(system).device_hit_tokens == SYSTEM_TOKENS]
        assert cached, "the tree caches no system prompt: fill it first"
        return cached


def serve(service: HiCacheService, tokens: list[int]) -> int:
    """One request's bookkeeping cycle: key (token checks), match, lock, alloc, insert,
    release, apply acks. Returns the tokens the match found on the device."""
    key, match, slots = admit(service, tokens)
    service.insert(key, slots)
    complete(service, len(tokens), match, slots)
    return match.device_hit_tokens


def admit(service: HiCacheService, tokens: list[int]) -> tuple[TokenKey, MatchResult, Indices]:
    """A request's calls before its insert: key, match, lock of the match, allocation of
    the new tokens' slots; returns the key, the match and the slots of every token."""
    key = service.key(tokens)
    match = service.match(key)
    service.lock(match.last_device_node)
    new = service.alloc_device(len(tokens) - match.device_hit_tokens)
    assert new is not None, "the benchmark's device pool is too small"
    slots = Indices(torch.cat([match.device_indices.tensor, new.tensor]), IndexSpace.DEVICE_FULL)
    return key, match, slots


def complete(service: HiCacheService, num_tokens: int, match: MatchResult,
             slots: Indices) -> None:
    """A request's calls after its insert: the partial page's slots freed, the match
    released, the step that issues the backup and applies acknowledgements."""
    free_tail(service, num_tokens, slots)
    service.release(match.last_device_node)
    service.step()


def free_tail(service: HiCacheService, num_tokens: int, slots: Indices) -> None:
    """Free the slots of ``num_tokens``' partial last page (the tree keeps whole pages)."""
    whole = num_tokens // PAGE * PAGE
    if len(slots) > whole:
        service.free_device(Indices(slots.tensor[whole:], IndexSpace.DEVICE_FULL))


def measure_insert(service: HiCacheService, workload: ChatWorkload, systems: list[list[int]],
                   repeats: int) -> list[float]:
    """The insert of a request (:meth:`ChatWorkload.request`: a cached system prompt and
    1024 new tokens, the cycle's requests), its other calls untimed around it. Under
    write-through the insert queues the backup of its new node; the service issues it at
    the request's ``step()`` (part of the cycle, not of this figure)."""
    times: list[float] = []
    for _ in range(repeats):
        tokens = workload.request(systems)
        key, match, slots = admit(service, tokens)
        start = time.perf_counter_ns()
        service.insert(key, slots)
        times.append((time.perf_counter_ns() - start) / 1e3)
        complete(service, len(tokens), match, slots)
    return times


def fill(service: HiCacheService, workload: ChatWorkload, target_tokens: int) -> None:
    """Serve prompts until the tree caches ``target_tokens`` (whole pages)."""
    while service.tree.stats.inserted_tokens < target_tokens:
        serve(service, workload.next_prompt())


def few_calls(repeats: int, least: int) -> int:
    """Calls of a figure whose call takes long (a 32k match, 2048 pages): a tenth of the
    repeats, at least ``least`` (the header names these counts)."""
    return max(least, repeats // 10)


def timed(call: Callable[[], object], repeats: int,
          before: Callable[[], object] | None = None) -> list[float]:
    """Microseconds of ``call`` per repeat (``before`` runs untimed before each)."""
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter_ns()
        call()
        out.append((time.perf_counter_ns() - start) / 1e3)
    return out


def measure_tree(size: int, repeats: int, seed: int) -> dict[str, list[float]]:
    """Every tree-size-dependent figure at a tree of ``size`` cached tokens."""
    service = make_service(capacity_tokens=capacity_for(size), host_ratio=1.0)
    try:
        # What the cache keeps: Python memory allocated while filling and still held once
        # the workload that made the prompts (and holds their token lists) is gone.
        filler = ChatWorkload(seed)
        gc.collect()
        tracemalloc.start()
        fill(service, filler, size)
        del filler
        gc.collect()
        tree_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        workload = ChatWorkload(seed)  # the same system prompts, so requests share them
        pages = max(1, service.tree.stats.inserted_tokens // PAGE)
        cached = workload.next_prompt()
        serve(service, cached)
        prompt_2k = cached[:SYSTEM_TOKENS] + workload._tokens(1024)
        prompt_32k = (cached * (32_768 // len(cached) + 1))[:32_768]
        key_2k, key_32k = service.key(prompt_2k), service.key(prompt_32k)
        # The workload just made a thousand system prompts (over a million ints in young
        # lists); the first collection of the interpreter's middle generation walks them
        # all, 12-18 ms that stop every thread under the GIL wherever they fall. An engine
        # pays that once per batch of new long-lived objects, not per call: start the
        # clocks with them promoted, as after an engine's warm-up.
        systems = workload.cached_systems(service)
        gc.collect()
        prompts: list[list[int]] = []
        out = {
            # the engine checks a request's tokens once (key) and matches with the key
            "key of a 2k-token prompt (token checks)": timed(
                lambda: service.key(prompt_2k), repeats),
            "match of a 2k-token prompt": timed(lambda: service.match(key_2k), repeats),
            "match of a 32k-token prompt": timed(lambda: service.match(key_32k),
                                                 few_calls(repeats, 3)),
            # a cached system prompt and 1024 new tokens, drawn before the clock starts
            # (the workload's generator is not the cache's cost)
            "one request's cycle (2k tokens)": timed(
                lambda: serve(service, prompts.pop()), repeats,
                before=lambda: prompts.append(workload.request(systems))),
            "insert of a 2k-token prompt (backup queued)": measure_insert(
                service, workload, systems, repeats),
            # evict() takes whole leaves; a request served between calls keeps the size
            "evict one page": timed(lambda: service.evict(PAGE), repeats,
                                    before=lambda: serve(service, workload.next_prompt())),
            "evict 10% of the tree": timed(lambda: service.evict(size // 10), 1),
            "check_integrity() (full, one hold of the lock)": timed(
                service.check_integrity, 1),
            **background_check_holds(service),
            "Python bytes per cached page": [tree_bytes / pages],
        }
        return out
    finally:
        service.stop()


def background_check_holds(service: HiCacheService) -> dict[str, list[float]]:
    """The longest hold of the service lock by one background integrity check (run here in
    the foreground, slice after slice, with no scheduler call between), in microseconds, and
    the longest with the garbage collector's collections that fell inside a hold taken out.

    A collection stops every Python thread (it holds the interpreter lock) wherever it
    falls, so one that a slice's allocations trigger stops the scheduler for as long with
    the service lock held or not: the second figure is what the check itself holds the
    lock for (as the thread-effect rows set apart the calls a collection stopped)."""
    check = service.background_check
    collections: list[tuple[float, float]] = []  # (start, end), perf_counter seconds
    begun = [0.0]

    def clock(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            begun[0] = time.perf_counter()
        else:
            collections.append((begun[0], time.perf_counter()))

    longest = longest_own = 0.0
    gc.callbacks.append(clock)
    try:
        done = False
        while not done:
            collections.clear()
            done = check.step()
            start, held = check.stats.last_start, check.stats.last_s
            inside = sum(max(0.0, min(end, start + held) - max(begin, start))
                         for begin, end in collections)
            longest, longest_own = max(longest, held), max(longest_own, held - inside)
    finally:
        gc.callbacks.remove(clock)
    return {"background integrity check, longest lock hold": [longest * 1e6],
            "the same, collections inside a hold excluded": [longest_own * 1e6]}
