"""Load-back at its edges: a host run exactly at the threshold or exactly at the quota is
loaded, a match with nothing host-only loads nothing, and a hybrid load that finds the SWA
pool full evicts SWA rows for the window it restores (CPU pools)."""

from __future__ import annotations

import torch
from radix_helpers import SENTINEL, HybridRig, Rig, expected_rows, find, host_only, read_rows

from hicache.radix import Refusal

A = [1, 1, 2, 2]


def test_a_host_run_as_long_as_the_threshold_is_loaded() -> None:
    rig = Rig(threshold=4)
    host_only(rig, A)
    loaded = rig.tree.load_back(find(rig.tree, A), 100)
    assert loaded.queued and loaded.num_tokens == 4 and len(loaded.device_indices) == 4
    assert not rig.tree.stats.refused_load_backs
    rig.tree.start_loading()
    rig.ack()
    assert rig.device_rows_ok(A, loaded.device_indices)
    rig.tree.check_integrity()


def test_a_host_run_as_long_as_the_quota_is_loaded() -> None:
    rig = Rig()
    host_only(rig, A)
    loaded = rig.tree.load_back(find(rig.tree, A), 4)
    assert loaded.queued and loaded.num_tokens == 4
    assert not rig.tree.stats.refused_load_backs
    rig.tree.start_loading()
    rig.ack()
    rig.tree.check_integrity()


def test_a_device_hit_loads_nothing() -> None:
    """A node already on the device: queued (nothing to wait for), no tokens, no slots,
    nothing locked, nothing counted."""
    rig = Rig(threshold=6)
    rig.put(A)
    rig.ack()
    node = find(rig.tree, A)
    free = rig.allocator.num_free_tokens
    loaded = rig.tree.load_back(node, 0)
    assert loaded.queued and loaded.refused is None
    assert loaded.num_tokens == 0 and len(loaded.device_indices) == 0
    assert loaded.restored_swa_tokens == 0
    assert node.lock_count == 0 and rig.allocator.num_free_tokens == free
    assert not rig.tree.stats.refused_load_backs and rig.tree.stats.loaded_back_tokens == 0
    rig.tree.check_integrity()


def test_a_hybrid_load_into_a_full_swa_pool_evicts_swa_rows_for_its_window() -> None:
    """The full pool has room, the SWA pool none: the load evicts the SWA rows of a backed-up
    sequence (enough for the loaded tail's window) and goes through. Evicting device nodes
    alone would not do: the least recently used one has no SWA rows left."""
    rig = HybridRig(full_pages=40, swa_pages=4)  # SWA history kept: evict_swa frees
    seq = [1, 2, 3, 4]
    rig.put(seq)
    rig.ack()
    assert rig.tree.evict(100) == 4  # host-only now
    old = [20, 21, 22, 23]
    rig.put(old)
    rig.ack()
    assert rig.tree.evict_swa(4) == 4  # its window's SWA rows go; its full rows stay
    for first in (40, 50):
        rig.put(list(range(first, first + 4)))
        rig.ack()
    assert rig.pool.swa_allocator.num_free_tokens == 0
    rig.pool.full.data.fill_(SENTINEL)
    rig.pool.swa.data.fill_(SENTINEL)
    loaded = rig.tree.load_back(find(rig.tree, seq), 100)
    assert loaded.queued, loaded.refused
    assert rig.tree.stats.refused_load_backs.get(Refusal.DEVICE_FULL.value, 0) == 0
    rig.tree.start_loading()
    rig.ack()
    slots = loaded.device_indices
    assert torch.equal(read_rows(rig.pool.full, slots.tensor), expected_rows(seq, 2))
    swa = rig.pool.swa_slots_of(slots).tensor
    assert torch.equal(read_rows(rig.pool.swa, swa), expected_rows(seq, 1, 0.5))
    assert find(rig.tree, old).device is None, "the full pool's eviction took it"
    rig.tree.check_integrity()
