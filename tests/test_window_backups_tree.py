"""Window backups on a tree used without a service (``HiRadixCache`` driven directly).

An audit found two gaps the service covered by itself: an ``insert`` of pages the tree
already caches freed those duplicate pages but kept the host copies of their SWA rows that
``back_up_window`` had made (host SWA slots leaked, and a later sequence given the same page
id adopted another sequence's rows, which a load-back then restored into its window); and
an ``insert`` of pages whose window copy was still in flight raised a bare assertion after
attaching nodes. The integrity check now refuses a window backup of a page the engine no
longer holds.
"""

from __future__ import annotations

import pytest
import torch
from radix_helpers import HybridRig, expected_rows, read_rows

from hicache.pools import IndexSpace, Indices

A = [1, 2, 3, 4, 5, 6, 7, 8]


def _a_second_copy_with_a_window_backup(rig: HybridRig) -> Indices:
    """A is cached; a second request computed A into its own pages and its first page left
    the window (its SWA rows copied to the host, acknowledged). Returns its slots."""
    rig.put(A)
    rig.ack()
    slots = rig.alloc(len(A))
    rig.write(A, slots)
    rig.tree.back_up_window(Indices(slots.tensor[:2], IndexSpace.DEVICE_FULL))
    rig.ack()
    assert len(rig.tree.window_backups) == 1
    return slots


def test_an_insert_of_duplicates_frees_their_window_copies() -> None:
    rig = HybridRig()
    slots = _a_second_copy_with_a_window_backup(rig)
    host_swa = rig.controller.host_swa.allocator
    used = host_swa.num_used_tokens
    rig.tree.insert(A, slots)  # every page a duplicate: the tree frees them
    assert not rig.pool.full_allocator.is_allocated(Indices(slots.tensor[:2],
                                                            IndexSpace.DEVICE_FULL))
    assert len(rig.tree.window_backups) == 0
    assert host_swa.num_used_tokens == used - 2  # the copy's slots are free again
    rig.tree.check_integrity()


def test_a_reused_page_restores_its_own_sequences_window() -> None:
    """End to end: the page id the duplicate freed goes to another sequence, whose SWA rows
    are backed up, evicted from the device and restored by a load-back."""
    rig = HybridRig()
    slots = _a_second_copy_with_a_window_backup(rig)
    first = int(slots.tensor[0])
    rig.tree.insert(A, slots)
    held = []
    while int((page := rig.alloc(2)).tensor[0]) != first:
        held.append(page)
    for other in held:
        rig.pool.free(other)
    tokens = [100, 101]
    rig.write(tokens, page)
    rig.tree.insert(tokens, page)
    rig.ack()
    rig.tree.evict_swa(100)
    assert not bool(rig.pool.swa_slots_of(page).tensor.ne(0).any())
    match = rig.tree.match_prefix([*tokens, 7, 7])
    rig.tree.lock(match.last_device_node)
    loaded = rig.tree.load_back(match.last_host_node, 64)
    assert loaded.queued and loaded.restored_swa_tokens == 2
    rig.tree.start_loading()
    rig.ack()
    got = read_rows(rig.pool.swa, rig.pool.swa_slots_of(page).tensor)
    assert torch.equal(got, expected_rows(tokens, 1, offset=0.5))
    rig.tree.unlock(match.last_device_node)
    rig.tree.check_integrity()


def test_an_insert_while_a_window_copy_is_in_flight_is_refused_and_changes_nothing() -> None:
    rig = HybridRig()
    slots = rig.alloc(len(A))
    rig.write(A, slots)
    rig.tree.back_up_window(Indices(slots.tensor[:2], IndexSpace.DEVICE_FULL))  # not acked
    with pytest.raises(ValueError, match=r"still being copied to the host \(back_up_window\); "
                                         r"apply_acks once the copy finished"):
        rig.tree.insert(A, slots)
    assert rig.tree.num_nodes == 0 and len(rig.tree.window_backups) == 1
    rig.tree.check_integrity(slots)  # the engine still holds them
    rig.ack()
    assert rig.tree.insert(A, slots) == 0  # once acknowledged: taken, with the copy
    assert len(rig.tree.window_backups) == 0
    rig.tree.check_integrity()


def test_the_integrity_check_refuses_a_window_copy_of_a_page_the_engine_gave_up() -> None:
    rig = HybridRig()
    slots = rig.alloc(len(A))
    rig.write(A, slots)
    rig.tree.back_up_window(Indices(slots.tensor[:2], IndexSpace.DEVICE_FULL))
    rig.ack()
    rig.tree.check_integrity(slots)
    with pytest.raises(RuntimeError, match=r"a window backup is of DEVICE_FULL page \d+, "
                                           r"which the engine no longer holds"):
        rig.tree.check_integrity(Indices(slots.tensor[2:], IndexSpace.DEVICE_FULL))
    rig.controller.evict_device(slots)  # freed past the tree: its copy stays behind
    with pytest.raises(RuntimeError, match=r"a window backup is of DEVICE_FULL page \d+, "
                                           r"which is free"):
        rig.tree.check_integrity()
