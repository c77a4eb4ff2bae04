"""Audit of the window backup's room and refusal counts (``release_window`` under
``host.swa_history: all``).

- Short of SWA host room, it evicted as many tokens of host-only leaves as the call named,
  not what was short: two cached prefixes dropped where one freed enough (the step's own
  backups pass the shortfall).
- A refused backup counted every token of the call as refused (``host_swa_full``), also
  those of pages whose SWA rows were already given back, which no backup was asked for.
"""

from __future__ import annotations

import torch

from hicache.config import config_from_dict
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices
from hicache.service import HiCacheService


def make_service() -> HiCacheService:
    return build_service(config_from_dict({
        "page_size_tokens": 2,
        "model": {"num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32", "swa_layers": [1], "window_tokens": 3},
        "device_pool": {"num_tokens": 32, "swa_num_tokens": 32, "device": "cpu"},
        "host": {"ratio": 0.25, "ram_reserve_gib": 0.0},  # 8 host tokens, 8 host SWA tokens
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 60.0},
    }))


def cache(service: HiCacheService, tokens: list[int]) -> None:
    slots = service.alloc_device(len(tokens))
    service.insert(tokens, slots)


def test_a_window_backup_short_of_room_evicts_only_the_shortfall() -> None:
    service = make_service()
    try:
        cache(service, [1, 2])
        cache(service, [3, 4])
        service.step()  # both backed up (full and SWA rows)
        service.evict(100)
        service.step()  # two host-only prefixes, 4 host SWA tokens
        assert service.tree.io.host_swa_free_tokens() == 4
        slots = service.alloc_device(12).tensor
        service.release_window(Indices(slots[:2].clone(), IndexSpace.DEVICE_FULL))
        service.step()
        assert service.tree.io.host_swa_free_tokens() == 2
        # 4 tokens of SWA rows leave the window: 2 tokens short, one 2-token leaf frees it
        service.release_window(Indices(slots[2:6].clone(), IndexSpace.DEVICE_FULL))
        assert service.tree.stats.evicted_host_tokens == 2
        assert service.match([3, 4]).host_hit_tokens == 2  # the more recent prefix stays
    finally:
        service.stop()


def test_a_refused_window_backup_counts_only_the_rows_it_would_copy() -> None:
    service = make_service()
    try:
        slots = service.alloc_device(12).tensor
        # 4 pages leave the window: their SWA rows fill the SWA host pool (8 tokens)
        service.release_window(Indices(slots[:8].clone(), IndexSpace.DEVICE_FULL))
        service.step()
        assert service.tree.io.host_swa_free_tokens() == 0
        assert service.tree.stats.window_backup_tokens == 8
        # page 0 has no SWA rows any more (skipped, per the docs); page 4 has 2 tokens of
        # rows, for which the full SWA host pool has no room: 2 tokens refused
        service.release_window(Indices(torch.cat([slots[0:2], slots[8:10]]).clone(),
                                       IndexSpace.DEVICE_FULL))
        assert service.tree.stats.refused_backups["host_swa_full"] == 2
    finally:
        service.stop()
