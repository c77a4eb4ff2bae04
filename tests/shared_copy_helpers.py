"""Tensor-parallel ranks of an MLA model with a store (:mod:`hicache.l3.shared_copy`): the
workloads of the spawned ranks of :func:`rank_helpers.run_ranks`, at module level so the
processes can import them."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
from rank_store_helpers import MODEL, store_config

from hicache.factory import build_service
from hicache.metrics import MetricsExporter
from hicache.service import HiCacheService

PROMPTS = [list(range(1000 * p, 1000 * p + 16)) for p in range(1, 9)]  # 8 pages each


def one_copy(rank: int, paths: list[str]) -> dict[str, Any]:
    """Each rank caches the same 8 prompts of 8 pages, backs them up to its store
    (``paths[rank]``) and steps until every put is agreed; the prompts then leave device
    and host, and each rank prefetches them from the store. Returns the rank's share, the
    pages it stored, what its store wrote and skipped, and per prompt the tokens found and
    the host hit after the prefetch."""
    group = dist.new_group(backend="gloo")
    service = build_service(store_config(paths[rank], mla=True, device_tokens=160),
                            tp_group=group, **MODEL)
    storage = service.storage
    assert storage is not None and storage.held is not None
    share = storage.backups.share
    exported = MetricsExporter(service.controller.stats, storage=lambda: storage).render().decode()
    [gauge] = [line for line in exported.splitlines()
               if line.startswith("hicache_l3_write_share_ranks ")]
    try:
        for tokens in PROMPTS:
            slots = service.alloc_device(len(tokens))
            assert slots is not None
            service.insert(tokens, slots)
        _step_until_agreed(service)
        in_storage = sum(node.in_storage for node in service.tree.nodes())
        stats = storage.store.stats()
        dist.barrier()
        assert service.evict(128) == 128 and service.evict_host(128) == 128
        found, host_hits = [], []
        for tokens in PROMPTS:
            prefetch = service.prefetch(tokens, service.match(tokens))
            assert prefetch is not None
            assert service.wait_prefetch(prefetch)
            found.append(prefetch.found_tokens)
            service.finish_prefetch(prefetch)
            host_hits.append(service.match(tokens).host_hit_tokens)
    finally:
        service.stop()
    service.check_integrity()
    return {"share": None if share is None else list(share), "in_storage": in_storage,
            "gauge": float(gauge.split()[1]),
            "stored": storage.stats.backup_pages["stored"], "written": stats.pages_written,
            "skipped": stats.pages_skipped, "found": found, "host_hits": host_hits}


def _step_until_agreed(service: HiCacheService) -> None:
    """Step until the host backups and every put they queued are agreed back."""
    storage = service.storage
    assert storage is not None and storage.held is not None
    for _ in range(2000):
        service.step()
        nodes = list(service.tree.nodes())
        if nodes and all(n.is_backed_up and n.store_op is None for n in nodes) \
                and not storage.held.num_held:
            return
        time.sleep(0.002)
    raise AssertionError("the puts were never agreed back")


def built_share(rank: int, url: str) -> dict[str, Any]:
    """The rank's share of the writes once its service is built on the store at ``url``."""
    group = dist.new_group(backend="gloo")
    service = build_service(store_config(url, mla=True), tp_group=group, **MODEL)
    assert service.storage is not None
    share = service.storage.backups.share
    service.stop()
    return {"share": None if share is None else list(share)}
