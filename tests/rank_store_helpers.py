"""Tensor-parallel ranks with a shared store (a real file store in a directory every rank
shares, each rank's pages under its own namespace): workloads for the spawned ranks of
:func:`rank_helpers.run_ranks`, at module level so the processes can import them."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import torch.distributed as dist
from rank_helpers import PAGE, config_dict, serve

from hicache.config import HiCacheConfig, config_from_dict
from hicache.factory import build_service
from hicache.l3 import Prefetch
from hicache.rank_agreement import RanksDivergedError
from hicache.service import HiCacheService
from hicache.storage import chain_page_hashes

MODEL = {"model_id": "test/tp-model", "model_revision": "r1"}


def store_config(path: str, *, policy: str = "write_through", write_policy: str = "write_through",
                 prefetch_policy: str = "wait_complete", hybrid: bool = False,
                 timeout_s: float = 0.005, device: str = "cpu", backend: str = "torch",
                 device_tokens: int = 32, mla: bool = False) -> HiCacheConfig:
    """:func:`rank_helpers.make_config` with a store that every tail of a page or more is
    asked about: a file store at ``path``, or the Redis server of ``path`` when it is a
    ``redis://`` URL. ``mla``: the model's layers keep one latent row a token (the ranks
    then share one copy in the store)."""
    mapping = config_dict(policy, hybrid=hybrid, device=device, backend=backend,
                          device_tokens=device_tokens)
    if mla:
        model = mapping["model"]
        del model["num_kv_heads"], model["head_dim"]
        model.update(attention="mla", latent_dim=3)
    where = {"backend": "redis", "url": path, "timeout_s": 0.5} \
        if path.startswith("redis://") else {"backend": "file", "path": path}
    mapping["storage"] = {
        **where, "write_policy": write_policy,
        "prefetch_policy": prefetch_policy, "prefetch_threshold_tokens": 0,
        "prefetch_timeout_s": timeout_s, "prefetch_timeout_max_s": max(timeout_s, 0.05),
        "prefetch_timeout_per_1024_tokens_s": 0.0, "write_through_hits": 1}
    if hybrid:
        mapping["host"]["swa_history"] = "all"
    return config_from_dict(mapping)


def step_until_stored(service: HiCacheService, pages: int) -> None:
    """Step until ``pages`` pages were stored (on a rank, every rank steps as often: the
    count moves only at agreed steps)."""
    assert service.storage is not None
    for _ in range(2000):
        if service.storage.stats.backup_pages["stored"] >= pages:
            return
        time.sleep(0.002)
        service.step()
    raise AssertionError("the puts never finished")


def lost_pages(rank: int, agreed: bool, path: str) -> dict[str, Any]:
    """Each rank caches one 16-token prompt, which goes to its store; rank 1's store then
    loses the prompt's last four pages; the prompt leaves device and host. Each rank then
    prefetches it from its store and matches again. Returns what each saw."""
    group = dist.new_group(backend="gloo") if agreed else None
    # with a group the pages are named by the group's rank; without one, by the arguments
    tp = {} if agreed else {"tp_rank": rank, "tp_size": 2}
    service = build_service(store_config(path), tp_group=group, **MODEL, **tp)
    assert service.storage is not None
    namespace_rank = service.storage.store.namespace.tp_rank
    tokens = list(range(100, 116))
    try:
        slots = service.alloc_device(16)
        assert slots is not None
        service.insert(tokens, slots)
        service.step()  # the host backup; its ack queues the put
        step_until_stored(service, 8)
        if rank == 1:
            hashes = chain_page_hashes(tokens, PAGE)
            assert service.storage.store.delete(hashes[4:]).num_leading_ok == 4
        dist.barrier()
        assert service.evict(16) == 16 and service.evict_host(16) == 16
        match = service.match(tokens)
        assert match.device_hit_tokens == match.host_hit_tokens == 0
        prefetch = service.prefetch(tokens, match)
        assert prefetch is not None
        assert service.wait_prefetch(prefetch)
        found = prefetch.found_tokens
        attached = service.finish_prefetch(prefetch)
        host_hit = service.match(tokens).host_hit_tokens
    finally:
        service.stop()
    service.check_integrity()
    return {"found": found, "attached": attached, "host_hit": host_hit,
            "namespace_rank": namespace_rank}


def store_traffic(rank: int, path: str | list[str], case: dict[str, Any], seed: int,
                  num_requests: int, kill: tuple[int, int] | None = None) -> dict[str, Any]:
    """The same requests on every rank (``seed``), each prefetched from the store first
    (finished when the policy says so, stepping meanwhile), with the background thread
    running, sleeps of up to 2 ms different on each rank, and each rank's store losing
    pages of its own choosing now and then. ``path``: the store, or each rank's. ``kill``:
    (request, pid): rank 1 kills that process (its store's server) before that request.
    Returns every request's answers."""
    group = dist.new_group(backend="gloo")
    where = path if isinstance(path, str) else path[rank]
    service = build_service(store_config(where, **case), tp_group=group, **MODEL)
    storage = service.storage
    assert storage is not None and service._poller.agreement is not None
    service.start()
    requests, skew = random.Random(seed), random.Random(1000 * seed + rank)
    systems = [[requests.randrange(1000) for _ in range(requests.choice([4, 6, 8]))]
               for _ in range(6)]
    answers: list[list[Any]] = []
    diverged = None
    try:
        for index in range(num_requests):
            if kill is not None and rank == 1 and index == kill[0]:
                os.kill(kill[1], signal.SIGKILL)  # this rank's store dies; rank 0's lives
            tokens = requests.choice(systems) + [
                requests.randrange(1000) for _ in range(requests.randrange(1, 8))]
            if skew.random() < 0.1:  # this rank's store loses a prompt's pages
                lost = chain_page_hashes(skew.choice(systems), PAGE)
                storage.store.delete(lost[skew.randrange(len(lost)):])
            time.sleep(skew.random() * 0.002)
            answers.append(_prefetched(service, tokens) + serve(service, tokens))
            time.sleep(skew.random() * 0.002)
            if requests.random() < 0.5:
                service.step()
        service.step()
    except RanksDivergedError as error:
        diverged = str(error)
    finally:
        service.stop()
    service.check_integrity()
    stats = storage.stats
    return {"answers": answers, "diverged": diverged, "stored": stats.backup_pages["stored"],
            "dropped": stats.backup_pages["dropped"], "failed": stats.backup_pages["failed"],
            "prefetches": stats.prefetches, "used": stats.prefetch_tokens["used"],
            "held": storage.held.num_held if storage.held is not None else -1,
            "share": None if storage.backups.share is None else list(storage.backups.share)}


def _prefetched(service: HiCacheService, tokens: list[int]) -> list[Any]:
    """Prefetch ``tokens``' uncached tail and finish it when ready (stepping until then):
    found tokens (-1: not asked), tokens attached, steps taken."""
    prefetch: Prefetch | None = service.prefetch(tokens, service.match(tokens))
    if prefetch is None:
        return [-1, 0, 0]
    steps = 0
    while not service.prefetch_ready(prefetch):
        time.sleep(0.0005)
        service.step()
        steps += 1
    found = prefetch.found_tokens
    return [found, service.finish_prefetch(prefetch), steps]
