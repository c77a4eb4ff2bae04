"""``write_back`` on both tiers (``controller.write_policy`` and ``storage.write_policy``),
host full: evicting a device prefix never backed up lost it on every tier and pushed twice
the needed host tokens to the store. Host eviction frees no room at once there (a host leaf
leaves once the store has it), which the write-back's allocation read as "no room": it
evicted a second host leaf, then dropped the prefix (``host_full``). It now keeps the
prefix on the device until the room on its way has come."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from test_l3_tier import MODEL, make_config, put, settle

from hicache.config import WritePolicy
from hicache.factory import build_service


def _write_back_both_tiers(tmp_path: Path) -> Any:
    """controller.write_policy and storage.write_policy both write_back; a 16-token device
    pool, a 32-token host pool (PAGE = 2), a file store."""
    config = make_config(tmp_path / "l3", policy="write_back", device_tokens=16)
    config = replace(config, controller=replace(config.controller,
                                                write_policy=WritePolicy.WRITE_BACK))
    service = build_service(config, **MODEL)
    # 8 prefixes of 4 tokens, each written back to the host on eviction: the host is full
    for i in range(8):
        put(service, [100 + i] * 4)
        service.evict(4)
        settle(service)
    assert service.tree.io.host_free_tokens() == 0
    assert sum(n.is_host_only for n in service.tree.nodes()) == 8
    return service


def test_write_back_eviction_on_full_host_evicts_only_what_it_needs(tmp_path: Path) -> None:
    """Evicting one 4-token device prefix needs 4 host tokens: one host leaf, written back
    to the store first (storage write_back), should leave the host, not two."""
    service = _write_back_both_tiers(tmp_path)
    try:
        stats = service.tree.stats
        before = stats.evicted_host_tokens
        put(service, [200] * 4)
        service.evict(4)
        settle(service)
        assert stats.evicted_host_tokens - before == 4, (
            f"{stats.evicted_host_tokens - before} host tokens evicted to make room for 4")
    finally:
        service.stop()


def test_write_back_eviction_on_full_host_keeps_the_prefix(tmp_path: Path) -> None:
    """Under write_back a prefix leaving the device is written back first; with the store's
    write_back making host room asynchronously the prefix must not be dropped (it has no
    copy anywhere) while host room is on its way."""
    service = _write_back_both_tiers(tmp_path)
    try:
        put(service, [200] * 4)
        service.evict(4)
        settle(service)
        assert service.tree.stats.dropped_tokens["host_full"] == 0
        match = service.match([200] * 4)
        assert match.device_hit_tokens + match.host_hit_tokens == 4, \
            "the evicted prefix was dropped: no copy on the device, host or store"
    finally:
        service.stop()
