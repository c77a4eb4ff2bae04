"""The tree at a few edges no other test reaches: looking up the device prefix never splits
a node, the engine cannot release a lock only the cache holds, a duplicate first page is
freed at page size 1, a tree built without arguments behaves as the default configuration
does, and a one-token window is valid (zero is refused in test_api_input_audit_2)
(CPU pools)."""

from __future__ import annotations

import inspect

import pytest
from radix_helpers import HybridRig, Rig, find

from hicache.config import SWAHistory
from hicache.config.sections import ControllerConfig, HostTierConfig
from hicache.radix import HiRadixCache

A = [1, 1, 2, 2, 3, 3, 4, 4]


def test_looking_up_the_device_prefix_splits_nothing() -> None:
    rig = Rig()
    rig.put(A)
    rig.ack()
    before = rig.tree.num_nodes
    diverging = [*A[:4], 9, 9]
    assert len(rig.tree.device_prefix(diverging)) == 4
    assert len(rig.tree.device_prefix_pages(diverging)) == 2
    assert sum(len(v) for v in rig.tree.device_prefix_views(diverging, "test")) == 4
    assert rig.tree.num_nodes == before and find(rig.tree, A).num_tokens == 8
    rig.tree.check_integrity()


def test_the_engine_cannot_release_a_lock_only_the_cache_holds() -> None:
    rig = Rig()
    rig.put(A)  # write-through: the backup holds a lock until its ack
    node = find(rig.tree, A)
    assert node.lock_count == 1 and node.caller_locks == 0
    with pytest.raises(RuntimeError, match="is not locked by the engine"):
        rig.tree.unlock(node, caller=True)
    assert node.lock_count == 1, "the cache's lock is untouched"
    rig.ack()
    assert node.lock_count == 0
    rig.tree.check_integrity()


def test_a_duplicate_single_token_page_is_freed() -> None:
    rig = Rig(page_size=1)
    rig.put([5])
    rig.ack()
    rig.put([5])  # the same token in a fresh slot: the tree keeps its own, frees this one
    assert rig.allocator.num_free_tokens == rig.allocator.capacity_tokens - 1
    assert rig.tree.stats.duplicate_tokens == 1
    rig.tree.check_integrity()


def test_a_tree_built_without_arguments_follows_the_default_configuration() -> None:
    defaults = inspect.signature(HiRadixCache.__init__).parameters
    controller = ControllerConfig
    assert defaults["write_policy"].default is controller.write_policy
    assert defaults["write_through_hits"].default == controller.write_through_hits
    assert defaults["load_back_threshold_tokens"].default == \
        controller.load_back_threshold_tokens
    assert defaults["eviction_policy"].default is controller.eviction_policy
    assert defaults["keep_swa_history"].default == (
        HostTierConfig.swa_history is SWAHistory.ALL)


def test_a_window_of_one_token_is_a_window() -> None:
    rig = HybridRig()
    tree = HiRadixCache(rig.controller, window_tokens=1)
    assert tree.io.tail_tokens == rig.page_size, "one token, rounded up to a page"
