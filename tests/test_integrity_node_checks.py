"""Each invariant ``check_integrity()`` guards, broken on purpose, is reported by name.

The other integrity tests break ownership (a page owned twice, a leak); these break one
node invariant at a time on a healthy tree, check that the full check names it, then undo
the change and check that the tree passes again, so each test shows that its break, and
nothing else, is what the check found. A check that stopped looking at one of these would
fail its test here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from radix_helpers import HybridRig, Rig, find

from hicache.config import WritePolicy
from hicache.pools import IndexSpace, Indices
from hicache.radix import TreeNode
from hicache.radix.key import TOKEN_BYTES
from hicache.radix.node import PendingStore

A = [1, 2, 3, 4, 5, 6, 7, 8]
WT, WB = WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK


@contextmanager
def broken(node: TreeNode, **fields: object) -> Iterator[None]:
    """``node`` with ``fields`` set inside the block, restored after it."""
    saved = {name: getattr(node, name) for name in fields}
    for name, value in fields.items():
        setattr(node, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(node, name, value)


def assert_reported(check: Callable[[], None], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        check()


def assert_break_reported(rig: Rig | HybridRig, node: TreeNode, message: str,
                          **fields: object) -> None:
    """The full check reports ``message`` with ``fields`` of ``node`` set, and passes once
    they are restored."""
    with broken(node, **fields):
        assert_reported(rig.tree.check_integrity, message)
    rig.tree.check_integrity()


def split_tree(policy: WritePolicy = WT) -> tuple[Rig, TreeNode, TreeNode]:
    """A tree holding ``A`` split after 4 tokens, every write acknowledged: (rig, parent,
    child), both on the device (and on the host with write-through)."""
    rig = Rig(write_policy=policy)
    rig.put(A)
    rig.put([*A[:4], 50, 51])  # splits A after its first 4 tokens
    rig.tree.issue_queued_backups()
    rig.ack()
    rig.tree.check_integrity()
    return rig, find(rig.tree, A[:4]), find(rig.tree, A)


def test_a_node_left_out_of_its_parent_is_reported() -> None:
    rig, _, child = split_tree()
    assert_break_reported(rig, child, "is not linked to its parent", is_detached=True)


def test_a_key_of_part_of_a_page_is_reported() -> None:
    rig, _, child = split_tree()
    assert_break_reported(rig, child, "is not whole pages", key=child.key[:-TOKEN_BYTES])


@pytest.mark.parametrize("field", ["device", "host"])
def test_slots_of_another_length_than_the_key_are_reported(field: str) -> None:
    rig, _, child = split_tree()
    slots: Indices = getattr(child, field)
    assert_break_reported(rig, child, f"{field} slots for its tokens",
                          **{field: Indices(slots.tensor[:-rig.page_size], slots.space)})


def test_a_parent_counting_fewer_locks_than_its_child_is_reported() -> None:
    rig, parent, child = split_tree()
    rig.tree.lock(child)
    assert_break_reported(rig, parent, r"lock count 0 < children's 1$",
                          lock_count=parent.lock_count - 1)
    rig.tree.unlock(child)
    rig.tree.check_integrity()


def test_engine_locks_beyond_the_lock_count_are_reported() -> None:
    rig, _, child = split_tree()
    assert_break_reported(rig, child, "the engine's", caller_locks=child.lock_count + 1)
    assert_break_reported(rig, child, "the engine's", caller_locks=-1)


def test_a_device_node_under_a_parent_off_the_device_is_reported() -> None:
    rig, parent, _ = split_tree()
    assert_break_reported(rig, parent, "is on the device but its parent", device=None)


def test_a_node_on_neither_tier_is_reported() -> None:
    rig, _, child = split_tree(WB)  # write-back: no host copy
    assert child.host is None
    assert_break_reported(rig, child, "on neither tier", device=None)


def test_a_queued_backup_with_host_slots_is_reported() -> None:
    rig = Rig(write_policy=WT)
    rig.tree.issue_backups = False  # as the service does: issued by its next step
    rig.put(A)
    node = find(rig.tree, A)
    assert node.write_op is not None and node.write_op.queued and node.host is None
    assert_break_reported(rig, node, "a queued backup needs",
                          host=Indices(node.device.tensor.clone(), IndexSpace.HOST_FULL))
    assert_break_reported(rig, node, "a queued backup needs", lock_count=0)
    rig.tree.issue_queued_backups()
    rig.ack()
    rig.tree.check_integrity()


def test_a_backup_in_flight_without_host_slots_is_reported() -> None:
    rig = Rig(write_policy=WT)
    rig.put(A)
    rig.tree.issue_queued_backups()
    node = find(rig.tree, A)
    assert node.write_op is not None and not node.write_op.queued and node.host is not None
    assert_break_reported(rig, node, "backup in flight but no host slots", host=None)
    rig.ack()
    rig.tree.check_integrity()


def test_an_eviction_waiting_for_no_write_is_reported() -> None:
    rig, _, child = split_tree()
    assert_break_reported(rig, child, "waits to be evicted after a write", evict_on_ack=True)


def test_a_node_missing_from_its_op_is_reported() -> None:
    rig = Rig(write_policy=WT)
    rig.put(A)
    rig.tree.issue_queued_backups()
    node = find(rig.tree, A)
    assert node.write_op is not None
    nodes = node.write_op.nodes
    node.write_op.nodes = [other for other in nodes if other is not node]
    assert_reported(rig.tree.check_integrity, "missing from its op")
    node.write_op.nodes = nodes
    rig.tree.check_integrity()


def test_a_store_of_a_node_without_a_host_copy_is_reported() -> None:
    rig, _, child = split_tree(WB)
    assert_break_reported(rig, child, "is being stored but has no complete host",
                          store_op=PendingStore([child]))


def test_a_host_page_in_flight_for_a_node_without_an_op_is_reported() -> None:
    """Host eviction trusts the node's flags: a host page the controller still moves must
    belong to a node whose op is in flight."""
    rig = Rig(write_policy=WT)
    rig.put(A)
    rig.tree.issue_queued_backups()  # the write is in flight until the ack
    node = find(rig.tree, A)
    op, locks = node.write_op, node.lock_count
    assert op is not None
    assert_break_reported(rig, node, "HOST_FULL page [0-9]+ is in flight but its node has no "
                          "op in flight", write_op=None, lock_count=locks - len(op.locks))
    rig.ack()
    rig.tree.check_integrity()


def test_pages_the_allocator_thinks_free_are_reported() -> None:
    rig, _, child = split_tree()
    assert child.device is not None
    rig.allocator.free(child.device)
    assert_reported(rig.tree.check_integrity, "is free in its allocator")
    again = rig.allocator.try_alloc(len(child.device))
    assert again is not None and again.tensor.tolist() == child.device.tensor.tolist()
    rig.tree.check_integrity()


def test_a_page_owned_by_a_node_and_held_by_the_engine_is_reported() -> None:
    rig, _, child = split_tree()
    assert child.device is not None
    assert_reported(lambda: rig.tree.check_integrity(engine_device=child.device),
                    "owned by a node and also held by the engine")
    rig.tree.check_integrity()


@pytest.mark.parametrize(("field", "space"), [("device_swa", IndexSpace.DEVICE_SWA),
                                               ("host_swa", IndexSpace.HOST_SWA)])
def test_swa_slots_in_a_model_without_swa_layers_are_reported(field: str,
                                                              space: IndexSpace) -> None:
    rig, _, child = split_tree()
    assert child.device is not None
    assert_break_reported(rig, child, f"no pool of space {space.name}",
                          **{field: Indices(child.device.tensor.clone(), space)})



def hybrid_node() -> tuple[HybridRig, TreeNode]:
    """A hybrid tree holding ``A`` on both tiers, every write acknowledged."""
    rig = HybridRig()
    rig.put(A)
    rig.tree.issue_queued_backups()
    rig.ack()
    rig.tree.check_integrity()
    node = find(rig.tree, A)
    assert node.device is not None and node.device_swa is not None
    assert node.host is not None and node.host_swa is not None
    return rig, node


def test_a_full_host_copy_without_swa_host_slots_is_reported() -> None:
    rig, node = hybrid_node()
    assert_break_reported(rig, node, "without SWA host slots", host_swa=None)


def test_device_swa_slots_that_differ_from_the_pools_map_are_reported() -> None:
    rig, node = hybrid_node()
    assert node.device_swa is not None
    moved = node.device_swa.tensor.clone()
    moved[moved != 0] = 0  # the tail's SWA slots forgotten: not what the pool maps
    assert not bool((moved == node.device_swa.tensor).all())
    assert_break_reported(rig, node, "differ from the pool's map",
                          device_swa=Indices(moved, IndexSpace.DEVICE_SWA))


def test_device_swa_slots_on_a_node_off_the_device_are_reported() -> None:
    rig, node = hybrid_node()
    assert_break_reported(rig, node, "device SWA slots but no device slots", device=None)


def test_swa_host_slots_of_a_node_with_no_full_rows_are_reported() -> None:
    rig, node = hybrid_node()
    assert_break_reported(rig, node, "on neither tier", device=None, device_swa=None, host=None)

def test_device_pages_in_flight_that_no_node_owns_are_reported() -> None:
    """Only the tree's nodes move full-attention pages: an op on pages the engine holds
    (made on the controller behind the tree's back) is reported, the engine's hold
    notwithstanding."""
    rig = Rig(write_policy=WT)
    held = rig.alloc(4)
    rig.controller.write(held)
    rig.controller.start_writing()
    assert_reported(lambda: rig.tree.check_integrity(engine_device=held),
                    "DEVICE_FULL page 1 is in flight but owned by no node")
