"""Replay of a Mooncake request trace through the service: bookkeeping requests/s and the
prefix hit rate, next to a block-level LRU cache of the same capacity replayed over the same
requests in the same run (the reference).

Trace format (:mod:`hicache.bench.trace_file`, which reads and validates it): ``input_length``
tokens and ``hash_ids``, one id per 512-token block; two requests that share a leading run of
ids share that prefix. Block ``b`` expands to the token ids ``b * 512 .. b * 512 + 511``
(distinct for distinct blocks), cut at ``input_length``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict

import torch

from hicache.pools import IndexSpace, Indices
from hicache.service import HiCacheService

from .scheduler import make_service
from .trace_file import BLOCK as BLOCK
from .trace_file import TraceError as TraceError
from .trace_file import TraceRequest as TraceRequest
from .trace_file import read_trace as read_trace


@dataclasses.dataclass(frozen=True)
class ReplayRow:
    """One capacity: hicache's hit rate and speed, and the LRU reference's hit rate."""

    device_blocks: int
    host_blocks: int
    requests: int
    input_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    seconds: float
    lru_blocks: int
    lru_hit_rate: float

    @property
    def hit_rate(self) -> float:
        return (self.device_hit_tokens + self.host_hit_tokens) / max(1, self.input_tokens)

    @property
    def requests_per_s(self) -> float:
        return self.requests / max(self.seconds, 1e-9)


def replay(requests: list[TraceRequest], device_blocks: int, host_blocks: int,
           page_size: int) -> ReplayRow:
    """Serve every request (match, lock, load back the host run, allocate the rest,
    insert, release, apply acks) through a CPU service of the given capacities.

    Only the service's calls are timed: a request's token list is made before its clock
    starts, as an engine's tokenizer makes it before hicache sees the request (building the
    list of a 13.7k-token request of the trace in Python takes about as long as serving
    it)."""
    service = make_service(device_blocks * BLOCK, host_blocks / device_blocks,
                           page_size=page_size)
    device_hits = host_hits = total = 0
    seconds = 0.0
    try:
        for request in requests:
            tokens = request.tokens()
            total += len(tokens)
            start = time.perf_counter()
            hit = _serve(service, tokens)
            seconds += time.perf_counter() - start
            device_hits += hit[0]
            host_hits += hit[1]
    finally:
        service.stop()
    lru = max(device_blocks, host_blocks)
    return ReplayRow(device_blocks, host_blocks, len(requests), total, device_hits, host_hits,
                     seconds, lru, lru_hit_rate(requests, lru))


def _serve(service: HiCacheService, tokens: list[int]) -> tuple[int, int]:
    """One request; returns (device hit tokens, host hit tokens loaded back)."""
    key = service.key(tokens)  # the token checks, once for the request
    match = service.match(key)
    node = match.last_host_node
    service.lock(node)
    prefix = match.device_indices.tensor
    host_hit = 0
    if match.host_hit_tokens:
        loaded = service.load_back(match, service.controller.device_allocator.capacity_tokens)
        if loaded.queued:
            service.start_loading()
            prefix = torch.cat([prefix, loaded.device_indices.tensor])
            host_hit = loaded.num_tokens
    need = max(0, len(tokens) - len(prefix))
    new = service.alloc_device(need) if need else None
    if need and new is None:  # the pools cannot hold this request: count it, cache nothing
        service.release(node)
        service.step()
        return match.device_hit_tokens, host_hit
    slots = prefix if new is None else torch.cat([prefix, new.tensor])
    service.insert(key, Indices(slots, IndexSpace.DEVICE_FULL))
    whole = len(tokens) // service.tree.page_size * service.tree.page_size
    if new is not None and len(slots) > whole:
        tail = slots[max(whole, len(prefix)):]
        if len(tail):
            service.free_device(Indices(tail, IndexSpace.DEVICE_FULL))
    service.release(node)
    service.step()
    return match.device_hit_tokens, host_hit


def lru_hit_rate(requests: list[TraceRequest], capacity_blocks: int) -> float:
    """Prefix hits of a block-level LRU cache of ``capacity_blocks`` (hit tokens capped at
    the input length), over ``requests``."""
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hit = total = 0
    for request in requests:
        total += request.input_length
        prefix_hit = 0
        for i in range(len(request.hash_ids)):
            key = request.hash_ids[: i + 1]
            if key not in cache:
                break
            prefix_hit += 1
        hit += min(prefix_hit * BLOCK, request.input_length)
        for i in range(len(request.hash_ids)):
            key = request.hash_ids[: i + 1]
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / max(1, total)
