"""Issuing queued backups: the background thread's way (``evict=False``) never evicts, so no
node an engine just matched leaves the tree before its lock, and writes backups that fit the
host as it is, exactly to its last page; the scheduler's way evicts host leaves for them,
down to a single token of room; a Ctrl-C while they are issued puts back on the queue only
what was neither written nor refused (CPU pools)."""

from __future__ import annotations

import pytest
from radix_helpers import Rig, find

from hicache.config import WritePolicy
from hicache.controller import Direction

OLD, NEW = [1, 1, 2, 2], [3, 3, 4, 4]


def host_leaf_and_queued_backup(rig: Rig, old: list[int], new: list[int]) -> None:
    """``old`` host-only (backed up, evicted from the device); then ``new`` cached with its
    backup queued, not issued (as the service queues them between steps)."""
    rig.put(old)
    rig.ack()
    assert rig.tree.evict(len(old)) == len(old)
    rig.tree.issue_backups = False
    rig.put(new)
    assert rig.tree.has_queued_backups


def test_the_background_way_leaves_a_host_leaf_and_keeps_the_backup_queued() -> None:
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH, host_pages=2)  # room for OLD only
    host_leaf_and_queued_backup(rig, OLD, NEW)
    node = find(rig.tree, NEW)
    rig.tree.issue_queued_backups(evict=False)
    assert find(rig.tree, OLD).host is not None, "nothing evicted"
    assert rig.tree.has_queued_backups and node.write_op is not None and node.write_op.queued
    assert node.lock_count == 1 and node.host is None
    assert not rig.tree.stats.refused_backups
    rig.tree.check_integrity()
    rig.tree.issue_queued_backups()  # the scheduler's step evicts for it
    rig.ack()
    assert rig.tree.match_prefix(OLD).host_hit_tokens == 0, "evicted for the backup"
    assert node.host is not None and node.write_op is None and node.lock_count == 0
    rig.tree.check_integrity()


def test_the_background_way_writes_a_backup_that_fills_the_host_exactly() -> None:
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH, host_pages=4)  # OLD and NEW, no more
    host_leaf_and_queued_backup(rig, OLD, NEW)
    assert rig.tree.io.host_free_tokens() == len(NEW)
    rig.tree.issue_queued_backups(evict=False)
    assert not rig.tree.has_queued_backups
    rig.ack()
    assert find(rig.tree, NEW).host is not None and find(rig.tree, OLD).host is not None
    assert rig.tree.io.host_free_tokens() == 0
    rig.tree.check_integrity()


def test_the_scheduler_way_evicts_for_a_single_token_short() -> None:
    """Pages of one token: a one-token backup into a full host evicts a host leaf."""
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH, page_size=1, host_pages=4)
    host_leaf_and_queued_backup(rig, [1, 2, 3, 4], [9])
    rig.tree.issue_queued_backups()
    rig.ack()
    assert find(rig.tree, [9]).host is not None
    assert not rig.tree.stats.refused_backups
    assert rig.tree.match_prefix([1, 2, 3, 4]).host_hit_tokens == 0
    rig.tree.check_integrity()


def test_an_interrupt_after_a_refusal_requeues_only_what_was_not_written_or_refused() -> None:
    """Two queued backups that do not fit together: the first (6 tokens) finds no room and
    is refused, the second (2 tokens) is allocated and a Ctrl-C lands as its copy is
    queued. The second goes back to the queue, the refused one does not; the next call
    writes the second."""
    rig = Rig(write_policy=WritePolicy.WRITE_THROUGH, host_pages=2)  # 4 tokens, all free
    rig.tree.issue_backups = False
    big, small = [1, 1, 2, 2, 3, 3], [5, 5]
    rig.put(big)
    rig.put(small)
    armed = [True]

    def interrupt_once(direction: Direction, transfers: object, tag: object) -> None:
        if armed and direction is Direction.DEVICE_TO_HOST:
            armed.clear()
            raise KeyboardInterrupt

    rig.controller.add_observer(interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        rig.tree.issue_queued_backups()
    assert not armed, "the interrupt landed"
    refused, queued = find(rig.tree, big), find(rig.tree, small)
    assert refused.write_op is None and refused.lock_count == 0 and refused.host is None
    assert rig.tree.stats.refused_backups["host_full"] == 6
    assert queued.write_op is not None and queued.write_op.queued and queued.host is None
    assert rig.tree.queued_backups == [queued.write_op]
    rig.tree.check_integrity()
    rig.tree.issue_queued_backups()
    rig.ack()
    assert queued.host is not None and queued.write_op is None and queued.lock_count == 0
    assert refused.host is None
    rig.tree.check_integrity()
