"""Room on the host for a write-back eviction's backup: a full host evicts a host leaf for
it, a host with exactly enough room evicts nothing (CPU pools)."""

from __future__ import annotations

from radix_helpers import Rig, find

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
