"""A backup that finds the full host pool with room and the SWA host pool without: the tree
evicts host-only leaves, oldest first, for the SWA rows the backup copies and no more: with
window tails only, its window's rows, not its every token's; with the SWA history, not the
rows a window backup already copied (CPU pools, a hybrid model)."""

from __future__ import annotations

from radix_helpers import HybridRig, find

from hicache.pools import IndexSpace, Indices

OLDER, NEWER = [10, 11, 12, 13], [20, 21, 22, 23]
LONG = list(range(30, 40))


def test_a_backup_short_of_swa_host_room_evicts_just_enough_host_leaves() -> None:
    # the SWA host pool holds 8 tokens, the full host pool 64; the tree keeps SWA rows for
    # each sequence's last 4 tokens (its window rounded up to pages)
    rig = HybridRig(keep_swa_history=False, swa_host_pages=4)
    for seq in (OLDER, NEWER):  # two host-only leaves, 4 SWA host tokens each
        rig.put(seq)
        rig.ack()
        assert rig.tree.evict(len(seq)) == len(seq)
    assert rig.tree.io.host_swa_free_tokens() == 0
    rig.tree.issue_backups = False
    rig.put(LONG)  # 10 tokens, SWA rows for the last 4
    rig.tree.issue_queued_backups()
    rig.ack()
    node = find(rig.tree, LONG)
    assert node.host is not None and node.host_swa is not None
    assert not rig.tree.stats.refused_backups
    assert rig.tree.match_prefix(OLDER).host_hit_tokens == 0, "evicted for the window's rows"
    assert rig.tree.match_prefix(NEWER).host_hit_tokens == 4, "4 SWA tokens were enough"
    assert rig.tree.io.host_swa_free_tokens() == 0
    rig.tree.check_integrity()


def test_rows_copied_by_a_window_backup_need_no_room_again() -> None:
    """Under ``swa_history: all`` a request's first page left its window and was copied to
    the host before its insert; the node's backup makes room for its other 6 SWA rows
    only (one 4-token leaf evicted, not two) and keeps the window copy's slots."""
    rig = HybridRig(swa_host_pages=6)  # 12 SWA host tokens
    for seq in (OLDER, NEWER):  # 8 SWA host tokens held by two host-only leaves
        rig.put(seq)
        rig.ack()
        assert rig.tree.evict(len(seq)) == len(seq)
    running = list(range(30, 38))
    slots = rig.alloc(len(running))
    rig.write(running, slots)
    rig.tree.back_up_window(Indices(slots.tensor[:2], IndexSpace.DEVICE_FULL))
    rig.ack()
    assert rig.tree.io.host_swa_free_tokens() == 2
    rig.tree.issue_backups = False
    rig.tree.insert(running, slots)
    node = find(rig.tree, running)
    assert node.host_swa is not None
    window_copy = node.host_swa.tensor[:2].tolist()
    assert all(window_copy) and not node.host_swa.tensor[2:].any()
    rig.tree.issue_queued_backups()
    rig.ack()
    assert node.host is not None and node.host_swa.tensor[:2].tolist() == window_copy
    assert bool(node.host_swa.tensor.ne(0).all())
    assert rig.tree.match_prefix(OLDER).host_hit_tokens == 0
    assert rig.tree.match_prefix(NEWER).host_hit_tokens == 4
    assert not rig.tree.stats.refused_backups and rig.tree.io.host_swa_free_tokens() == 0
    rig.tree.check_integrity()
