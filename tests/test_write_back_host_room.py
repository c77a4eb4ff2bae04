"""Room on the host for a write-back eviction's backup: a full host evicts a host leaf for
it, a host with exactly enough room evicts nothing, a host that cannot take it drops the
node, and a hybrid backup short of SWA host room evicts a host leaf whole (CPU pools)."""

from __future__ import annotations

from radix_helpers import HybridRig, Rig, find

from hicache.config import WritePolicy

OLD, NEW = [1, 1, 2, 2], [3, 3, 4, 4]


def evicted_to_host(rig: Rig, tokens: list[int]) -> None:
    """Cache ``tokens`` and evict them from the device: under write_back the eviction backs
    them up first and frees the device slots at the ack."""
    rig.put(tokens)
    assert rig.tree.evict(len(tokens)) == 0, "freed at the ack, not now"
    rig.ack()
    node = find(rig.tree, tokens)
    assert node.device is None and node.host is not None


def test_a_write_back_into_a_full_host_evicts_a_host_leaf_for_it() -> None:
    rig = Rig(write_policy=WritePolicy.WRITE_BACK, host_pages=2)  # room for one of them
    evicted_to_host(rig, OLD)
    assert rig.tree.io.host_free_tokens() == 0
    evicted_to_host(rig, NEW)
    assert rig.tree.match_prefix(OLD).host_hit_tokens == 0, "evicted for NEW's backup"
    assert not rig.tree.stats.refused_backups
    rig.tree.check_integrity()


def test_a_write_back_that_fills_the_host_exactly_evicts_nothing() -> None:
    rig = Rig(write_policy=WritePolicy.WRITE_BACK, host_pages=4)
    evicted_to_host(rig, OLD)
    assert rig.tree.io.host_free_tokens() == len(NEW)
    evicted_to_host(rig, NEW)
    assert find(rig.tree, OLD).host is not None
    assert rig.tree.io.host_free_tokens() == 0
    assert rig.tree.stats.evicted_host_tokens == 0
    rig.tree.check_integrity()


def test_a_write_back_the_host_cannot_take_drops_the_node() -> None:
    """The host is full of a leaf the engine holds: the evicted node cannot be backed up,
    so it leaves the device without a copy (counted as dropped for ``host_full``)."""
    rig = Rig(write_policy=WritePolicy.WRITE_BACK, host_pages=2)
    evicted_to_host(rig, OLD)
    held = find(rig.tree, OLD)
    rig.tree.lock(held)
    rig.put(NEW)
    assert rig.tree.evict(len(NEW)) == 4, "freed now: no write to wait for"
    assert rig.tree.stats.refused_backups["host_full"] == 4
    assert rig.tree.stats.dropped_tokens["host_full"] == 4
    assert [node.num_tokens for node in rig.tree.nodes()] == [4] and held.host is not None
    assert rig.allocator.num_free_tokens == rig.allocator.capacity_tokens
    rig.tree.unlock(held)
    rig.tree.check_integrity()


def test_a_hybrid_write_back_short_of_swa_host_room_evicts_a_host_leaf_whole() -> None:
    """The full host pool has room, the SWA host pool none: the host-only leaf holding it
    leaves whole (every cached prefix stays reusable), not just its SWA copies."""
    rig = HybridRig(write_policy=WritePolicy.WRITE_BACK, swa_host_pages=2,
                    keep_swa_history=False)
    first, second = [10, 11, 12, 13], [20, 21, 22, 23]
    for tokens in (first, second):
        rig.put(tokens)
        assert rig.tree.evict(len(tokens)) == 0
        rig.ack()
    assert [node.tokens for node in rig.tree.nodes()] == [tuple(second)]
    assert find(rig.tree, second).host_swa is not None
    assert not rig.tree.stats.refused_backups
    rig.tree.check_integrity()
