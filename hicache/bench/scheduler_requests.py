"""``hicache bench scheduler``'s end-to-end figure: 2k-token requests with shared prefixes,
served back to back through the service, in requests per second.

A request is the system prompt of one of the workload's conversations (``SYSTEM_TOKENS``,
cached while the tree was filled) followed by new tokens up to ``REQUEST_TOKENS``, as a
chat's new conversation reaches the engine: the shared prefix hits, the rest is allocated,
inserted and backed up to the host (write-through), and once the pools are full every
request also evicts on both tiers. Every request's token list is made before the clock
starts (an engine's tokenizer makes it before hicache sees the request); the clock then
covers the service's calls of :func:`~hicache.bench.scheduler.serve` for all requests, one
after the other with nothing between them. A second row per tree serves them as an engine
batches them: ``BATCH`` requests admitted and inserted, then released, then one ``step()``
(which issues their backups as one write op).
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass

from hicache.service import HiCacheService

from .scheduler import (
    REQUEST_TOKENS,
    SYSTEM_TOKENS,
    VOCAB,
    ChatWorkload,
    admit,
    capacity_for,
    fill,
    free_tail,
    make_service,
    serve,
)

TARGET_REQUESTS_PER_S = 2000.0  # the scheduler-path issue's end-to-end target
BATCH = 16  # requests per scheduler step in the batched row


@dataclass(frozen=True)
class RequestsRow:
    """Requests served back to back at one tree size (tokens cached before the first)."""

    tree_tokens: int
    requests: int
    prompt_tokens: int
    device_hit_tokens: int
    seconds: float
    per_step: int = 1  # requests served between two steps

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def hit_rate(self) -> float:
        return self.device_hit_tokens / self.prompt_tokens


def measure_requests(size: int, count: int, seed: int, per_step: int = 1) -> RequestsRow:
    """Serve ``count`` 2k-token requests back to back on a tree filled to ``size`` cached
    tokens (the service of the other tree figures: the device pool of ``capacity_for``, a
    host as large), ``per_step`` of them between two steps."""
    if count < 1 or per_step < 1:
        raise ValueError(f"measure_requests: count and per_step must be >= 1, got {count} "
                         f"and {per_step}")
    service = make_service(capacity_tokens=capacity_for(size), host_ratio=1.0)
    try:
        workload = ChatWorkload(seed)
        fill(service, workload, size)
        rng = random.Random(seed + 1)
        prompts = [rng.choice(workload.histories)[:SYSTEM_TOKENS]
                   + [rng.randrange(VOCAB) for _ in range(REQUEST_TOKENS - SYSTEM_TOKENS)]
                   for _ in range(count)]
        # the prompts are young lists of ints (millions at 1000 requests): the first
        # collection of the middle generation would walk them all on the clock, a cost of
        # this benchmark's tokenizer, not of the cache (see measure_tree)
        gc.collect()
        start = time.perf_counter_ns()
        if per_step == 1:
            hits = sum(serve(service, prompt) for prompt in prompts)
        else:
            hits = sum(serve_step(service, prompts[at:at + per_step])
                       for at in range(0, count, per_step))
        seconds = (time.perf_counter_ns() - start) / 1e9
    finally:
        service.stop()
    return RequestsRow(size, count, count * REQUEST_TOKENS, hits, seconds, per_step)


def serve_step(service: HiCacheService, prompts: list[list[int]]) -> int:
    """One scheduler step of ``prompts``: each admitted (key, match, lock, alloc) and
    inserted, its partial page freed; then every match released and one step. Returns the
    tokens the matches found on the device."""
    matches = []
    for tokens in prompts:
        key, match, slots = admit(service, tokens)
        service.insert(key, slots)
        free_tail(service, len(tokens), slots)
        matches.append(match)
    for match in matches:
        service.release(match.last_device_node)
    service.step()
    return sum(match.device_hit_tokens for match in matches)


def render_requests(rows: list[RequestsRow]) -> str:
    """The end-to-end table: one line per tree size."""
    lines = [f"end to end: {REQUEST_TOKENS}-token requests with shared prefixes "
             f"({SYSTEM_TOKENS} cached tokens of a conversation's system prompt, the rest "
             f"new), back to back through the service's calls; 'a step': requests served "
             f"between two step() calls",
             f"{'tree':>9} {'a step':>7} {'requests':>9} {'device hit':>10} {'req/s':>9} "
             f"{'target':>8}", "-" * 57]
    for row in rows:
        lines.append(f"{row.tree_tokens:>9} {row.per_step:>7} {row.requests:>9} "
                     f"{row.hit_rate:>10.1%} {row.requests_per_s:>9.1f} "
                     f"{TARGET_REQUESTS_PER_S:>8g}")
    return "\n".join(lines)
