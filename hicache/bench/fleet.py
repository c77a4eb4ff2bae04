"""Fleet replay: a Mooncake trace served by N service instances in one process, requests
routed round-robin, sharing one store (L3) or not, next to the trace's ideal prefix hit rate.

Every instance is a CPU service of one layer of 2-element rows and 512-token pages (the
trace's block, so a request is a few dozen store objects). The replay is the engine's
synchronous path of ``hicache.prefetch_calls``: match, prefetch the uncached tail from the
store and wait for it, match again, load the host run back, compute (write the rows of) the
rest, insert. Rows are a function of each token and its position (:func:`expected_rows`),
so the rows a request reuses are checked bit for bit against what its tokens must have:
a hit that brings wrong bytes ends the replay with :class:`FleetError`.

Between requests the instance that served one applies its host and store backups before the
next request comes (:func:`settle`): in the trace the next request comes 0.3 s later and the
engine decodes for seconds meanwhile; the replay has no such gap (``settle=False`` shows what
asynchronous backups lose without it).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import numpy as np
import torch

from hicache.config import HiCacheConfig, config_from_dict
from hicache.factory import build_service
from hicache.pools import DeviceKVPool, IndexSpace, Indices
from hicache.radix import TokenKey
from hicache.service import HiCacheService

from .trace import BLOCK, TraceRequest

MODEL_ID = "hicache-bench/fleet"
SETTLE_TIMEOUT_S = 30.0
WAIT_PREFETCH_S = 30.0


class FleetError(RuntimeError):
    """The replay failed: rows that came back wrong, or backups that never finished."""


@dataclasses.dataclass
class FleetRow:
    """One fleet (instances, capacities, store): tokens reused by tier, speed, store bytes."""

    instances: int
    storage: str  # "none", "file" or "redis"
    device_blocks: int
    host_blocks: int
    requests: int = 0
    input_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    l3_hit_tokens: int = 0
    """Tokens attached from the store by a prefetch and loaded back for the request."""
    seconds: float = 0.0
    ideal_hit_rate: float = 0.0
    l3_bytes_written: int = 0
    l3_bytes_read: int = 0
    verified_requests: int = 0
    verified_l3_tokens: int = 0
    prefetch_tokens: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        hits = self.device_hit_tokens + self.host_hit_tokens + self.l3_hit_tokens
        return hits / max(1, self.input_tokens)

    @property
    def share_of_ideal(self) -> float:
        return self.hit_rate / self.ideal_hit_rate if self.ideal_hit_rate else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / max(self.seconds, 1e-9)


def fleet_config(device_blocks: int, host_blocks: int, storage: str | None,
                 prefetch_policy: str = "wait_complete") -> HiCacheConfig:
    """An instance's config: ``storage`` is a directory, a ``redis://`` URL or ``None``."""
    section: dict[str, object] = {"backend": "none"}
    if storage is not None:
        where = {"url": storage} if storage.startswith("redis") else {"path": storage}
        section = {"backend": "redis" if "url" in where else "file", **where,
                   "write_policy": "write_through", "prefetch_policy": prefetch_policy}
    return config_from_dict({
        "page_size_tokens": BLOCK,
        "model": {"num_layers": 1, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": device_blocks * BLOCK, "device": "cpu"},
        "host": {"ratio": host_blocks / device_blocks, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 3600.0},
        "storage": section,
    })


def trace_tokens(request: TraceRequest) -> np.ndarray:
    """``[input_length]`` int64 token ids: block ``b`` is ``b * 512 .. b * 512 + 511``."""
    blocks = np.asarray(request.hash_ids, dtype=np.int64)[:, None] * BLOCK
    return (blocks + np.arange(BLOCK, dtype=np.int64)).reshape(-1)[:request.input_length]


def expected_rows(tokens: np.ndarray, start: int) -> torch.Tensor:
    """``[n, 2, 1, 2]`` float32 rows (K, V; one layer) of ``tokens`` at positions ``start..``:
    K holds the token id (high and low 12 bits), V the position and 1; exact in float32."""
    ids = torch.from_numpy(tokens)
    positions = torch.arange(start, start + len(tokens), dtype=torch.int64)
    values = torch.stack([ids >> 12, ids & 4095, positions, torch.ones_like(ids)], dim=1)
    return values.to(torch.float32).view(-1, 2, 1, 2)


def _pool(service: HiCacheService) -> DeviceKVPool:
    pool = service.device_pool
    assert isinstance(pool, DeviceKVPool), "the fleet's model has no SWA layers"
    return pool


def _write_rows(service: HiCacheService, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """The engine's forward pass: rows ``[n, C, L, R]`` into device ``slots``."""
    _pool(service).data[:, :, slots] = rows.permute(1, 2, 0, 3)


def _verify(service: HiCacheService, tokens: np.ndarray, slots: torch.Tensor, where: str
            ) -> None:
    """The rows at ``slots`` are those of ``tokens[:len(slots)]``, bit for bit."""
    got = _pool(service).data[:, :, slots].permute(2, 0, 1, 3)
    want = expected_rows(tokens[:len(slots)], 0)
    bad = (got != want).flatten(1).any(dim=1).nonzero()
    if len(bad):
        raise FleetError(f"{where}: the rows reused at token {int(bad[0])} (of {len(slots)} "
                         f"reused) are not that token's: a hit returned wrong bytes")


@dataclasses.dataclass
class Served:
    """What one request reused, by tier (tokens)."""

    device: int = 0
    host: int = 0
    l3: int = 0
    verified: bool = False


def serve(service: HiCacheService, key: TokenKey, tokens: np.ndarray, verify: bool,
          where: str) -> Served:
    """One request (``tokens``, ``key`` their key) on one instance (module docstring);
    ``verify``: check the reused rows."""
    match = service.match(key)
    attached = 0
    prefetch = service.prefetch(key, match)
    if prefetch is not None:
        if not service.wait_prefetch(prefetch, timeout_s=WAIT_PREFETCH_S):
            raise FleetError(f"{where}: a prefetch was not ready after {WAIT_PREFETCH_S} s")
        attached = service.finish_prefetch(prefetch)
        if attached:
            match = service.match(key)
    node = match.last_host_node
    service.lock(node)
    prefix = match.device_indices.tensor
    served = Served(device=match.device_hit_tokens)
    if match.host_hit_tokens:
        loaded = service.load_back(match, service.controller.device_allocator.capacity_tokens)
        if loaded.queued:
            service.start_loading()
            prefix = torch.cat([prefix, loaded.device_indices.tensor])
            served.l3 = min(attached, loaded.num_tokens)
            served.host = loaded.num_tokens - served.l3
    new = service.alloc_device(len(tokens) - len(prefix))
    if new is None:  # the pools cannot hold this request: count its hits, cache nothing
        service.release(node)
        return served
    _write_rows(service, new.tensor[:len(tokens) - len(prefix)],
                expected_rows(tokens[len(prefix):], len(prefix)))
    if verify and len(prefix):
        _verify(service, tokens, prefix, where)
        served.verified = True
    slots = torch.cat([prefix, new.tensor])
    service.insert(key, Indices(slots, IndexSpace.DEVICE_FULL))
    whole = len(tokens) // BLOCK * BLOCK
    if len(slots) > max(whole, len(prefix)):
        service.free_device(Indices(slots[max(whole, len(prefix)):], IndexSpace.DEVICE_FULL))
    service.release(node)
    return served


def settle(service: HiCacheService, key: TokenKey) -> None:
    """Apply acks until no node of ``key``'s path waits for its host or store backup."""
    tree = service.tree
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        service.step()
        # the path without a match's side effects (no split, hit count or access time)
        path = tree._descend(tree.key_data(key, "settle"), split=False)
        if not any(n.write_op is not None or n.store_op is not None for n, _ in path):
            return
        if time.monotonic() > deadline:
            raise FleetError(f"backups of a request not applied after {SETTLE_TIMEOUT_S} s")
        tier = service.storage
        if tier is not None:
            tier.backup_worker.wait_finished(0.01)


def replay_fleet(requests: list[TraceRequest], row: FleetRow, storage: str | None, *,
                 prefetch_policy: str = "wait_complete", verify_every: int = 1,
                 settle_backups: bool = True, model_revision: str = "r1",
                 clear_store: bool = False) -> FleetRow:
    """Serve ``requests`` round-robin on ``row.instances`` new instances of ``row``'s
    capacities sharing ``storage`` (a directory, a ``redis://`` URL, or ``None``: L1+L2
    only); fills ``row``'s counts and returns it. ``verify_every``: check the reused rows
    of every n-th request (0: none). ``model_revision`` names the store's namespace;
    ``clear_store``: remove its pages at the end (a Redis server outlives the run)."""
    config = fleet_config(row.device_blocks, row.host_blocks, storage, prefetch_policy)
    fleet = []
    try:
        for _ in range(row.instances):
            fleet.append(build_service(config, model_id=MODEL_ID, model_revision=model_revision))
        start = time.perf_counter()
        for i, request in enumerate(requests):
            service = fleet[i % len(fleet)]
            tokens = trace_tokens(request)
            key = service.key(tokens)
            verify = verify_every > 0 and i % verify_every == 0
            served = serve(service, key, tokens, verify, f"request {i} on instance "
                           f"{i % len(fleet)}")
            if settle_backups:
                settle(service, key)
            else:
                service.step()
            row.requests += 1
            row.input_tokens += len(tokens)
            row.device_hit_tokens += served.device
            row.host_hit_tokens += served.host
            row.l3_hit_tokens += served.l3
            row.verified_requests += served.verified
            row.verified_l3_tokens += served.l3 if served.verified else 0
        row.seconds = time.perf_counter() - start
        _count_store(fleet, row)
        if clear_store and fleet[0].storage is not None:
            fleet[0].storage.store.clear()
    finally:
        for service in fleet:
            service.stop()
    return row


def _count_store(fleet: list[HiCacheService], row: FleetRow) -> None:
    """The store's bytes and the prefetch outcomes, over every instance."""
    outcomes: Counter[str] = Counter()
    for service in fleet:
        if service.storage is None:
            continue
        stats = service.storage.store.stats()
        row.l3_bytes_written += stats.bytes_written
        row.l3_bytes_read += stats.bytes_read
        outcomes.update(service.storage.stats.prefetch_tokens)
    row.prefetch_tokens = dict(outcomes)
