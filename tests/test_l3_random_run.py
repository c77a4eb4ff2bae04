"""Random traffic through two services sharing one file store: prefetches finished at random
moments (before, during and after their reads), evictions on both tiers, every write policy;
every loaded row is compared with the rows its tokens were computed with, and the integrity
check (slot conservation with the tier's held slots) runs throughout."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import pytest
import torch
from gpu_shapes import scaled
from radix_helpers import expected_rows, read_rows
from test_l3_tier import MODEL, PAGE, make_config, pool_of, put

from hicache.factory import build_service
from hicache.l3 import Prefetch
from hicache.l3.jobs import PrefetchPhase
from hicache.service import HiCacheService


def prompts(rng: random.Random) -> list[list[int]]:
    """Shared system prompts with branching continuations."""
    roots = [[1000 * r + i for i in range(rng.choice([4, 8, 12]))] for r in range(4)]
    out = []
    for _ in range(24):
        base = rng.choice(roots)
        tail = [rng.randrange(50, 90) for _ in range(rng.choice([2, 4, 6, 10]))]
        out.append(base + tail)
    return out


def load(service: HiCacheService, tokens: list[int], rng: random.Random,
         pending: list[tuple[HiCacheService, Prefetch]]) -> None:
    key = service.key(tokens)
    match = service.match(key)
    if rng.random() < 0.5:
        prefetch = service.prefetch(key, match)
        if prefetch is not None:
            if rng.random() < 0.4:
                pending.append((service, prefetch))  # finished in a later op
                return
            if rng.random() < 0.7:
                service.wait_prefetch(prefetch, timeout_s=5.0)
            service.finish_prefetch(prefetch)
            match = service.match(key)
    loaded = service.load_back(match, 10**6)
    if not loaded.queued:
        return
    service.start_loading()
    service.step()
    slots = torch.cat([match.device_indices.tensor, loaded.device_indices.tensor])
    pool = pool_of(service)
    assert torch.equal(read_rows(pool, slots), expected_rows(tokens[:len(slots)],
                                                             pool.num_layers)), \
        "a loaded prefix holds rows of other tokens"


def fetch_from_store(service: HiCacheService, requests: list[list[int]]) -> int:
    """Empty ``service``'s device and host tiers, then prefetch ``requests`` from the
    store one by one, each until the store's worker is done with it (whatever the prefetch
    policy says: best effort finishes at once), until one brings pages; load that prefix
    back (its rows checked) and return the tokens the prefetch attached (0 when none did).
    The requests are tried again for up to 20 s: the puts of the run may still be on their
    way to the store (its threads run at their own pace, slower on a loaded machine)."""
    service.step()
    service.evict(10**6)
    service.step()
    service.evict_host(10**6)
    give_up = time.monotonic() + 20.0
    while True:
        for tokens in requests:
            key = service.key(tokens)
            prefetch = service.prefetch(key, service.match(key))
            if prefetch is None:
                continue
            until = time.monotonic() + 5.0
            while prefetch.job.phase is not PrefetchPhase.DONE and time.monotonic() < until:
                service.prefetch_ready(prefetch)  # the tier takes the store's answers
                prefetch.job.changed.wait(0.01)
            attached = service.finish_prefetch(prefetch)
            if attached:
                load(service, tokens, random.Random(0), [])
                return attached
        if time.monotonic() > give_up:
            return 0
        time.sleep(0.05)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_through_a_shared_store(tmp_path: Path, policy: str, seed: int,
                                               hybrid: bool) -> None:
    rng = random.Random(seed)
    config = make_config(tmp_path / "l3", policy=policy, device_tokens=24, hybrid=hybrid,
                         prefetch=rng.choice(["best_effort", "wait_complete", "timeout"]))
    services = [build_service(config, **MODEL), build_service(config, **MODEL)]
    pending: list[tuple[HiCacheService, Prefetch]] = []
    requests = prompts(rng)
    try:
        for step in range(scaled(600, 150)):
            service = rng.choice(services)
            op = rng.random()
            if pending and rng.random() < 0.3:
                owner, prefetch = pending.pop(rng.randrange(len(pending)))
                owner.finish_prefetch(prefetch)
            elif op < 0.35:
                tokens = rng.choice(requests)
                service.evict(len(tokens) + PAGE)
                service.step()
                if service.alloc_device(0) is not None:
                    with contextlib.suppress(AssertionError):  # no room now: the engine waits
                        put(service, tokens)
            elif op < 0.75:
                load(service, rng.choice(requests), rng, pending)
            elif op < 0.85:
                service.evict(rng.randrange(1, 16))
            elif op < 0.95:
                service.evict_host(rng.randrange(1, 24))
            else:
                service.step()
            if step % 25 == 0:
                for each in services:
                    each.check_integrity()
        for owner, prefetch in pending:
            owner.finish_prefetch(prefetch)
        for each in services:
            each.step()
            each.check_integrity()
        # The random prefetches may all have been finished before anything arrived (the
        # store's threads run at their own pace): one service, emptied, now fetches the
        # requests from the store, each waited for, until a page comes, and loads it.
        fetched = fetch_from_store(services[0], requests)
        tiers = [s.storage for s in services]
        assert all(t is not None for t in tiers)
        used = sum(t.stats.prefetch_tokens["used"] for t in tiers if t is not None)
        assert fetched > 0 and used >= fetched, "no page ever came from the store"
    finally:
        for each in services:
            each.stop()
    for each in services:
        each.check_integrity()
        assert each.controller.host_pool is not None
