"""HiRadixCache over a hybrid (full + sliding-window) pool, on a CPU.

Model: 3 layers, layer 1 sliding-window with a 3-token window, pages of 2 tokens. With
``host.swa_history: window_tails`` (``keep_swa_history=False``) the tree keeps SWA slots
for the last 4 tokens (2 pages) of every inserted sequence only; with ``all`` it keeps
every SWA row until it has a host copy and ``evict_swa`` frees it.
"""

from __future__ import annotations

import pytest
import torch
from radix_helpers import SENTINEL, HybridRig, expected_rows, find, ids, read_rows

from hicache.pools import IndexSpace, Indices
from hicache.radix import Refusal

SEQ = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_insert_keeps_swa_slots_for_the_window_tail_only() -> None:
    """Of 10 tokens, the first 6 lose their SWA slots and the last 4 keep theirs."""
    rig = HybridRig(keep_swa_history=False)
    _, slots = rig.put(SEQ)
    node = find(rig.tree, SEQ)
    swa = ids(node.device_swa)
    assert swa[:6] == [0] * 6 and all(swa[6:])
    assert ids(rig.pool.swa_slots_of(slots)) == swa
    assert rig.pool.swa_allocator.num_used_tokens == 4
    rig.tree.check_integrity()


def test_insert_keeps_swa_slots_the_tree_already_owned() -> None:
    """Extending a cached sequence leaves the SWA tail of the shorter one in place."""
    rig = HybridRig(keep_swa_history=False)
    rig.put(SEQ[:4])
    rig.put(SEQ)
    short, rest = find(rig.tree, SEQ[:4]), find(rig.tree, SEQ)
    assert all(ids(short.device_swa))
    assert ids(rest.device_swa)[:2] == [0, 0] and all(ids(rest.device_swa)[2:])
    assert rig.pool.swa_allocator.num_used_tokens == 8
    rig.tree.check_integrity()


def test_duplicates_are_freed_with_their_swa_slots() -> None:
    """Inserting cached tokens again returns both full and SWA slots to their pools."""
    rig = HybridRig()
    rig.put(SEQ[:4])
    full_free = rig.pool.full_allocator.num_free_tokens
    swa_free = rig.pool.swa_allocator.num_free_tokens
    rig.put(SEQ[:4])
    assert rig.pool.full_allocator.num_free_tokens == full_free
    assert rig.pool.swa_allocator.num_free_tokens == swa_free
    rig.tree.check_integrity()


def test_write_evict_load_back_restores_full_and_swa_rows() -> None:
    """Every full row and every SWA row of the window tail come back bit for bit."""
    rig = HybridRig(keep_swa_history=False)
    rig.put(SEQ)
    rig.ack()
    node = find(rig.tree, SEQ)
    assert ids(node.host_swa)[:6] == [0] * 6 and all(ids(node.host_swa)[6:])
    assert rig.tree.evict(100) == 10
    assert rig.pool.swa_allocator.num_used_tokens == 0
    rig.pool.full.data.fill_(SENTINEL)
    rig.pool.swa.data.fill_(SENTINEL)
    loaded = rig.tree.load_back(node, 100)
    assert loaded.queued
    slots = loaded.device_indices
    rig.tree.start_loading()
    rig.ack()
    assert torch.equal(read_rows(rig.pool.full, slots.tensor), expected_rows(SEQ, 2))
    swa = rig.pool.swa_slots_of(slots).tensor
    assert swa[:6].eq(0).all() and swa[6:].ne(0).all()
    assert torch.equal(read_rows(rig.pool.swa, swa[6:]), expected_rows(SEQ, 1, 0.5)[6:])
    assert ids(node.device_swa) == swa.tolist()
    rig.tree.check_integrity()


def test_load_back_refused_when_the_tail_has_no_swa_backup() -> None:
    """A prefix cut out of a longer sequence has no SWA rows for its own tail."""
    rig = HybridRig(keep_swa_history=False)
    rig.put(SEQ)
    rig.ack()
    rig.tree.match_prefix(SEQ[:6])  # split: tokens 0..5 never had SWA rows kept
    rig.tree.evict(100)
    free = rig.pool.full_allocator.num_free_tokens
    assert rig.tree.load_back(find(rig.tree, SEQ[:6]), 100).refused is Refusal.SWA_TAIL_MISSING
    assert rig.tree.stats.refused_load_backs["swa_tail_missing"] == 6
    assert rig.pool.full_allocator.num_free_tokens == free
    assert rig.tree.load_back(find(rig.tree, SEQ), 100).queued, "whole sequence has a tail"
    rig.tree.start_loading()
    rig.ack()
    rig.tree.check_integrity()


def test_integrity_counts_engine_swa_slots() -> None:
    """SWA slots of engine-held full slots are the engine's, not a leak."""
    rig = HybridRig()
    held = rig.pool.try_alloc(4)
    assert held is not None
    with pytest.raises(RuntimeError, match="leak"):
        rig.tree.check_integrity()
    rig.tree.check_integrity(engine_device=held)
    rig.pool.free(Indices(held.tensor, IndexSpace.DEVICE_FULL))
    rig.tree.check_integrity()


def test_with_swa_history_insert_keeps_every_swa_row_until_it_is_backed_up() -> None:
    """Under ``all`` an insert frees no SWA row (an engine that never calls release_window
    loses nothing): the write-through backup copies them, ``evict_swa`` then frees the
    device rows, and a prefix cut out of the sequence gets its window back."""
    rig = HybridRig()
    rig.put(SEQ)
    node = find(rig.tree, SEQ)
    assert all(ids(node.device_swa)) and rig.pool.swa_allocator.num_used_tokens == 10
    rig.ack()
    assert all(ids(node.host_swa))
    assert rig.tree.evict_swa(10) == 10 and rig.pool.swa_allocator.num_used_tokens == 0
    rig.tree.match_prefix(SEQ[:6])  # split: the cut's window (tokens 2..5) lies inside
    rig.tree.evict(100)
    rig.pool.full.data.fill_(SENTINEL)
    rig.pool.swa.data.fill_(SENTINEL)
    cut = find(rig.tree, SEQ[:6])
    loaded = rig.tree.load_back(cut, 100)
    assert loaded.queued and loaded.num_tokens == 6
    rig.tree.start_loading()
    rig.ack()
    swa = rig.pool.swa_slots_of(loaded.device_indices).tensor
    assert swa[2:].ne(0).all()
    assert torch.equal(read_rows(rig.pool.swa, swa[2:]), expected_rows(SEQ, 1, 0.5)[2:6])
    rig.tree.check_integrity()
