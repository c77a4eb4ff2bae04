"""HiRadixCache on a CPU: matching, splits, write policies, eviction, load-back, integrity.

Pools have pages of 2 tokens; allocators hand out the lowest free pages first, so the first
device allocation gets slots 2, 3, ... and so does the first host allocation: expectations
below are exact slot ids.
"""

from __future__ import annotations

import pytest
import torch
from radix_helpers import (
    NUM_LAYERS,
    SENTINEL,
    Rig,
    expected_rows,
    find,
    full_indices,
    host_only,
    ids,
    read_rows,
)

from hicache.config import EvictionPolicy, WritePolicy
from hicache.radix import Refusal
from hicache.radix.tree import slots_of

A = [1, 2, 3, 4, 5, 6, 7, 8]
WT, WTS, WB = WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_THROUGH_SELECTIVE, WritePolicy.WRITE_BACK


# ---- matching and insertion ---------------------------------------------------------------


def test_match_returns_exact_device_prefix() -> None:
    """A longer query matches the inserted pages; a diverging one stops at the page."""
    rig = Rig()
    cached, slots = rig.put(A[:6])
    assert cached == 0 and ids(slots) == ids(rig.tree.device_prefix(A)) == list(range(2, 8))
    full = rig.tree.match_prefix([*A, 9])
    assert ids(full.device_indices) == [2, 3, 4, 5, 6, 7] and full.host_hit_tokens == 0
    assert full.last_device_node is full.last_host_node
    partial = rig.tree.match_prefix([1, 2, 3, 9])
    assert ids(partial.device_indices) == [2, 3]
    assert partial.last_device_node.tokens == (1, 2)
    rig.tree.check_integrity()


def test_keys_truncate_to_whole_pages() -> None:
    """Only whole pages are inserted and matched; the tail slot stays the caller's."""
    rig = Rig()
    cached, slots = rig.put([1, 2, 3, 4, 5])
    assert cached == 0 and ids(slots) == [2, 3, 4, 5]
    assert rig.tree.match_prefix([1, 2, 3, 4, 5]).device_hit_tokens == 4
    assert rig.allocator.num_free_tokens == rig.allocator.capacity_tokens - 4
    rig.tree.check_integrity()


def test_host_only_and_mixed_prefixes() -> None:
    """Evicting the leaf of a split node leaves a device prefix plus a host run."""
    rig = Rig(write_policy=WT)
    rig.put(A)
    rig.ack()
    rig.tree.match_prefix(A[:4])  # split after 4 tokens
    assert rig.tree.evict(1) == 4
    mixed = rig.tree.match_prefix(A)
    assert ids(mixed.device_indices) == [2, 3, 4, 5] and mixed.host_hit_tokens == 4
    assert mixed.last_device_node.tokens == (1, 2, 3, 4)
    assert mixed.last_host_node.tokens == (5, 6, 7, 8)
    assert rig.tree.evict(1) == 4
    host_only = rig.tree.match_prefix(A)
    assert host_only.device_hit_tokens == 0 and host_only.host_hit_tokens == 8
    assert host_only.last_device_node is rig.tree.root
    rig.tree.check_integrity()


def test_split_keeps_every_slot_array_aligned() -> None:
    """A split with a write in flight slices device and host slots at the same offset."""
    rig = Rig(write_policy=WT)
    rig.put(A)  # device 2..9, host 2..9, write not yet acknowledged
    cached, _ = rig.put([1, 2, 3, 4, 7, 7])  # caller slots 10..15: 10..13 are duplicates
    assert cached == 4
    upper, lower, new = find(rig.tree, A[:4]), find(rig.tree, A), find(rig.tree, [1, 2, 3, 4, 7, 7])
    assert ids(upper.device) == [2, 3, 4, 5] and ids(upper.host) == [2, 3, 4, 5]
    assert ids(lower.device) == [6, 7, 8, 9] and ids(lower.host) == [6, 7, 8, 9]
    assert ids(new.device) == [14, 15] and ids(new.host) == [10, 11]
    assert upper.write_op is lower.write_op and upper.lock_count == 2
    assert rig.allocator.is_allocated(full_indices([14, 15]))
    assert not rig.allocator.is_allocated(full_indices([10, 11])), "duplicates were not freed"
    rig.ack()
    assert (upper.lock_count, lower.lock_count) == (0, 0)
    assert upper.write_op is None and lower.write_op is None
    rig.tree.check_integrity()


def test_insert_with_the_trees_own_slots_frees_nothing() -> None:
    """Re-inserting matched slots keeps them; nothing is counted as a duplicate."""
    rig = Rig()
    rig.put(A)
    match = rig.tree.match_prefix(A)
    free = rig.allocator.num_free_tokens
    assert rig.tree.insert(A, match.device_indices) == 8
    assert rig.allocator.num_free_tokens == free and rig.tree.stats.duplicate_tokens == 0
    rig.tree.check_integrity()


def test_insert_frees_duplicate_slots() -> None:
    """The same tokens inserted with fresh slots: the fresh slots go back to the pool."""
    rig = Rig()
    rig.put(A)
    free = rig.allocator.num_free_tokens
    cached, slots = rig.put(A)
    assert cached == 8 and rig.allocator.num_free_tokens == free
    assert not rig.allocator.is_allocated(slots) and rig.tree.stats.duplicate_tokens == 8
    rig.tree.check_integrity()


def test_insert_frees_only_the_fresh_pages_among_the_trees_own() -> None:
    """One node's pages handed back partly as the tree's own, partly fresh: only the
    fresh pages are duplicates (freed); the node keeps its own slots and rows."""
    rig = Rig()
    _, own = rig.put(A)  # one node of four pages: slots 2..9
    fresh = rig.alloc(4)  # slots 10..13
    given = own.tensor.clone()
    given[2:4], given[6:8] = fresh.tensor[:2], fresh.tensor[2:]  # pages 2 and 4 replaced
    free = rig.allocator.num_free_tokens
    assert rig.tree.insert(A, full_indices(given.tolist())) == 8
    assert rig.tree.stats.duplicate_tokens == 4
    assert rig.allocator.num_free_tokens == free + 4 and not rig.allocator.is_allocated(fresh)
    assert ids(rig.tree.device_prefix(A)) == ids(own) and rig.device_rows_ok(A, own)
    rig.tree.check_integrity()


def test_insert_reattaches_an_evicted_node() -> None:
    """A host-only node gets the caller's new device slots and keeps its host copy."""
    rig = Rig(write_policy=WT)
    rig.put(A)
    rig.ack()
    rig.tree.evict(8)
    cached, slots = rig.put(A)
    node = find(rig.tree, A)
    assert cached == 8 and ids(node.device) == ids(slots) and ids(node.host) == list(range(2, 10))
    assert rig.tree.match_prefix(A).device_hit_tokens == 8
    rig.tree.check_integrity()


def test_insert_rejects_slots_it_cannot_own() -> None:
    """Free slots, host slots and too few slots are caller errors."""
    rig = Rig()
    with pytest.raises(ValueError, match="not allocated"):
        rig.tree.insert([1, 2], full_indices([2, 3]))
    with pytest.raises(ValueError, match="need >= 4"):
        rig.tree.insert([1, 2, 3, 4], rig.alloc(2))


# ---- eviction order -----------------------------------------------------------------------


def _three_leaves(rig: Rig) -> None:
    for token in (1, 2, 3):
        rig.put([token, token])
    rig.ack()


def _device_keys(rig: Rig) -> list[tuple[int, ...]]:
    return sorted(node.tokens for node in rig.tree.nodes() if node.on_device)


def test_lru_evicts_least_recently_used_first() -> None:
    """Insert 1, 2, 3, touch 2: eviction order is 1, 3, 2."""
    rig = Rig(write_policy=WT)
    _three_leaves(rig)
    rig.tree.match_prefix([2, 2])
    order = []
    for _ in range(3):
        before = set(_device_keys(rig))
        assert rig.tree.evict(1) == 2
        order.append((before - set(_device_keys(rig))).pop())
    assert order == [(1, 1), (3, 3), (2, 2)]


def test_lfu_evicts_least_hit_first() -> None:
    """Hits 1 -> 2, 3 -> 1, 2 -> 0: eviction order is 2, 3, 1."""
    rig = Rig(write_policy=WT, eviction_policy=EvictionPolicy.LFU)
    _three_leaves(rig)
    for tokens in ([1, 1], [1, 1], [3, 3]):
        rig.tree.match_prefix(tokens)
    order = []
    for _ in range(3):
        before = set(_device_keys(rig))
        rig.tree.evict(1)
        order.append((before - set(_device_keys(rig))).pop())
    assert order == [(2, 2), (3, 3), (1, 1)]


def test_parents_wait_for_their_children() -> None:
    """The oldest node is an inner node: its leaves go first."""
    rig = Rig(write_policy=WT)
    rig.put([1, 1, 2, 2])
    rig.put([1, 1, 3, 3])  # splits: (1, 1) -> (2, 2), (3, 3)
    rig.ack()
    assert rig.tree.evict(2) == 2 and rig.tree.evict(2) == 2
    assert _device_keys(rig) == [(1, 1)]


# ---- write policies -----------------------------------------------------------------------


def test_write_through_backs_up_on_insert() -> None:
    """The insert queues the backup, locks the node until the ack, then the host holds it."""
    rig = Rig(write_policy=WT)
    rig.put(A[:4])
    node = find(rig.tree, A[:4])
    assert ids(node.host) == [2, 3, 4, 5] and node.write_op is not None and node.lock_count == 1
    assert rig.tree.evict(4) == 0, "a node being written was evicted"
    assert rig.ack() == 1
    assert node.is_backed_up and node.lock_count == 0
    assert torch.equal(rig.host.read_rows(slots_of(node, "host")), expected_rows(A[:4], NUM_LAYERS))
    assert rig.tree.stats.backed_up_tokens == 4


def test_write_through_selective_waits_for_hits() -> None:
    """With write_through_hits=2 the second match triggers the backup."""
    rig = Rig(write_policy=WTS, hits=2)
    rig.put(A[:4])
    node = find(rig.tree, A[:4])
    rig.tree.match_prefix(A[:4])
    assert node.host is None
    rig.tree.match_prefix(A[:4])
    assert ids(node.host) == [2, 3, 4, 5] and node.write_op is not None
    rig.ack()
    assert node.is_backed_up and node.lock_count == 0


def test_write_back_frees_device_slots_only_after_the_ack() -> None:
    """Eviction writes first; the device slots stay allocated until the ack is applied."""
    rig = Rig(write_policy=WB)
    rig.put(A[:4])
    node = find(rig.tree, A[:4])
    rig.tree.match_prefix(A[:4])
    assert node.host is None, "write_back backed up before eviction"
    assert rig.tree.evict(4) == 0
    assert node.evict_on_ack and ids(node.device) == [2, 3, 4, 5] and ids(node.host) == [2, 3, 4, 5]
    assert rig.allocator.is_allocated(full_indices([2, 3, 4, 5]))
    rig.tree.check_integrity()
    rig.ack()
    assert node.device is None and node.is_backed_up
    assert rig.allocator.num_free_tokens == rig.allocator.capacity_tokens
    assert torch.equal(rig.host.read_rows(slots_of(node, "host")), expected_rows(A[:4], NUM_LAYERS))
    assert rig.tree.stats.evicted_device_tokens == 4


def test_write_back_eviction_is_cancelled_for_a_locked_node() -> None:
    """A node locked while its write-back was in flight keeps its device slots."""
    rig = Rig(write_policy=WB)
    rig.put(A[:4])
    rig.tree.evict(4)
    match = rig.tree.match_prefix(A[:4])
    rig.tree.lock(match.last_device_node)
    rig.ack()
    node = find(rig.tree, A[:4])
    assert ids(node.device) == [2, 3, 4, 5] and node.is_backed_up and not node.evict_on_ack
    rig.tree.unlock(node)
    rig.tree.check_integrity()


def test_backed_up_node_keeps_its_host_copy() -> None:
    """Device eviction of a backed-up node frees only its device slots."""
    rig = Rig(write_policy=WT)
    rig.put(A[:4])
    rig.ack()
    assert rig.tree.evict(4) == 4
    node = find(rig.tree, A[:4])
    assert node.device is None and ids(node.host) == [2, 3, 4, 5]
    assert rig.tree.match_prefix(A[:4]).host_hit_tokens == 4
    rig.tree.check_integrity()


def test_node_without_backup_is_dropped_with_a_reason() -> None:
    """Under write_through_selective a never-backed-up leaf is deleted and counted."""
    rig = Rig(write_policy=WTS)
    rig.put(A[:4])
    assert rig.tree.evict(4) == 4
    assert rig.tree.match_prefix(A[:4]).device_hit_tokens == 0
    assert rig.tree.stats.dropped_tokens["no_backup"] == 4 and not list(rig.tree.nodes())
    assert rig.allocator.num_free_tokens == rig.allocator.capacity_tokens


def test_dropping_a_node_drops_the_host_copies_below_it() -> None:
    """A dropped parent takes its host-only child along (counted as orphaned)."""
    rig = Rig(write_policy=WTS, hits=1, host_pages=1)  # the host fits the child, not the parent
    rig.put([1, 1, 2, 2])
    rig.put([1, 1, 2, 2, 3, 3])
    rig.tree.match_prefix([1, 1, 2, 2, 3, 3])
    rig.ack()
    assert rig.tree.stats.refused_backups["host_full"] == 4
    assert rig.tree.evict(6) == 6
    assert rig.tree.stats.dropped_tokens == {"no_backup": 4, "orphaned": 2}
    assert rig.host.allocator.num_free_tokens == rig.host.allocator.capacity_tokens
    rig.tree.check_integrity()


# ---- load-back ----------------------------------------------------------------------------


def test_load_back_below_threshold_is_refused() -> None:
    rig = Rig(threshold=6)
    host_only(rig, A[:4])
    refused = rig.tree.load_back(find(rig.tree, A[:4]), 100)
    assert refused.refused is Refusal.BELOW_THRESHOLD and refused.num_tokens == 4
    assert len(refused.device_indices) == 0 and not refused.queued
    assert refused.restored_swa_tokens == 0
    assert rig.tree.stats.refused_load_backs["below_threshold"] == 4


def test_load_back_over_quota_is_refused() -> None:
    rig = Rig()
    host_only(rig, A[:4])
    assert rig.tree.load_back(find(rig.tree, A[:4]), 2).refused is Refusal.OVER_QUOTA
    assert rig.tree.stats.refused_load_backs["over_quota"] == 4


def test_load_back_is_all_or_nothing() -> None:
    """With room for 2 of 4 tokens and nothing evictable, nothing is allocated."""
    rig = Rig(device_pages=4)
    host_only(rig, A[:4])
    rig.put([5, 5, 6, 6, 7, 7])
    match = rig.tree.match_prefix([5, 5, 6, 6, 7, 7])
    rig.tree.lock(match.last_device_node)
    assert rig.allocator.num_free_tokens == 2
    assert rig.tree.load_back(find(rig.tree, A[:4]), 100).refused is Refusal.DEVICE_FULL
    assert rig.allocator.num_free_tokens == 2 and find(rig.tree, A[:4]).lock_count == 0
    assert rig.tree.stats.refused_load_backs["device_full"] == 4
    rig.tree.check_integrity()


def test_load_back_evicts_and_retries() -> None:
    """A full device is evicted once, then the load goes through."""
    rig = Rig(device_pages=4)
    host_only(rig, A[:4])
    rig.put([5, 5, 6, 6, 7, 7])
    rig.ack()
    loaded = rig.tree.load_back(find(rig.tree, A[:4]), 100)
    assert loaded.queued and len(loaded.device_indices) == loaded.num_tokens == 4
    assert find(rig.tree, [5, 5, 6, 6, 7, 7]).device is None
    rig.tree.start_loading()
    rig.ack()
    rig.tree.check_integrity()


def test_load_back_restores_rows_bit_for_bit() -> None:
    """Rows of two split nodes come back exactly; the lock holds until the ack."""
    rig = Rig()
    rig.put(A[:6])
    rig.put([1, 2, 3, 4, 9, 9])
    rig.ack()
    rig.tree.evict(100)
    rig.pool.data.fill_(SENTINEL)
    match = rig.tree.match_prefix(A[:6])
    assert (match.device_hit_tokens, match.host_hit_tokens) == (0, 6)
    loaded = rig.tree.load_back(match.last_host_node, 100)
    assert loaded.queued and match.last_host_node.lock_count == 1
    slots = loaded.device_indices
    rig.tree.start_loading()
    rig.ack()
    assert match.last_host_node.lock_count == 0
    assert torch.equal(read_rows(rig.pool, slots.tensor), expected_rows(A[:6], NUM_LAYERS))
    assert ids(rig.tree.match_prefix(A[:6]).device_indices) == ids(slots)
    assert rig.tree.stats.loaded_back_tokens == 6
    rig.tree.check_integrity()



def test_load_back_reads_the_nodes_own_slots() -> None:
    """A load-back of one node: its op reads the node's host slots as they are and the node
    gets the very device slots the op fills (no copies: the tree never changes a slot
    tensor in place); the engine gets a copy of its own, whose change reaches neither; the
    rows come back."""
    rig = Rig()
    host_only(rig, A[:4])
    node = find(rig.tree, A[:4])
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    rig.controller.add_observer(lambda _d, transfers, _t: seen.append(
        (transfers[0].host_indices.tensor, transfers[0].device_indices.tensor)))
    host = node.host
    loaded = rig.tree.load_back(node, 100)
    assert loaded.queued and host is not None and node.device is not None
    assert len(seen) == 1 and seen[0][0] is host.tensor and seen[0][1] is node.device.tensor
    assert loaded.device_indices.tensor is not node.device.tensor
    slots = node.device.tensor.clone()
    loaded.device_indices.tensor.fill_(7)  # the engine's copy
    rig.tree.start_loading()
    rig.ack()
    assert torch.equal(node.device.tensor, slots)
    assert torch.equal(read_rows(rig.pool, slots), expected_rows(A[:4], NUM_LAYERS))
    rig.tree.check_integrity()


def test_locks_prevent_eviction() -> None:
    """A locked prefix survives evict(everything) until it is unlocked."""
    rig = Rig()
    rig.put(A[:4])
    rig.put([9, 9])
    rig.ack()
    node = rig.tree.match_prefix(A[:4]).last_device_node
    rig.tree.lock(node)
    assert rig.tree.evict(100) == 2 and node.on_device
    rig.tree.unlock(node)
    assert rig.tree.evict(100) == 4 and not node.on_device
    with pytest.raises(RuntimeError, match="not locked"):
        rig.tree.unlock(node)


def test_evict_host_spares_device_and_in_flight_nodes() -> None:
    """A node on the device or loading keeps its host copy; a host-only leaf is freed."""
    rig = Rig()
    rig.put(A[:4])
    rig.ack()
    assert rig.tree.evict_host(100) == 0
    rig.tree.evict(4)
    node = find(rig.tree, A[:4])
    rig.tree.load_back(node, 100)  # queued, not started: host slots in flight
    assert rig.controller.is_in_flight(slots_of(node, "host")) and rig.tree.evict_host(100) == 0
    rig.tree.start_loading()
    rig.ack()
    rig.tree.evict(4)
    assert rig.tree.evict_host(100) == 4 and node.is_detached
    assert rig.host.allocator.num_free_tokens == rig.host.allocator.capacity_tokens
    rig.tree.check_integrity()


# ---- integrity ----------------------------------------------------------------------------


def test_integrity_catches_double_ownership() -> None:
    rig = Rig()
    rig.put([1, 1])
    rig.put([2, 2])
    find(rig.tree, [2, 2]).device = find(rig.tree, [1, 1]).device
    with pytest.raises(RuntimeError, match="owned by nodes"):
        rig.tree.check_integrity()


def test_integrity_counts_engine_slots_and_catches_leaks() -> None:
    rig = Rig()
    held = rig.alloc(4)
    with pytest.raises(RuntimeError, match="leak"):
        rig.tree.check_integrity()
    rig.tree.check_integrity(engine_device=held)


def test_device_prefix_pages_are_the_pages_of_device_prefix() -> None:
    rig = Rig()
    _, slots = rig.put(A)
    rig.put([*A[:4], 50, 51, 52, 53])  # a split: the prefix of A spans two nodes
    pages = rig.tree.device_prefix_pages(A)
    page = rig.tree.page_size
    prefix = rig.tree.device_prefix(A).tensor.numpy()
    assert pages.tolist() == (prefix[::page] // page).tolist() == (
        slots.tensor.numpy()[::page] // page).tolist()
    assert rig.tree.device_prefix_pages([999, 998]).size == 0
