"""Backups of device nodes to the host: queued by ``insert`` and ``match``, issued per step.

A write-through backup is queued where the policy asks for it: the node gets a queued
:class:`~hicache.radix.node.PendingOp` and one lock, nothing else (no host slot, no
controller call). :func:`issue_queued` then serves every backup queued since its last call
at once: one host eviction for what the host lacks, one host allocation and one controller
write for all their nodes, so a scheduler step of many requests pays for one of each. A
service calls it at every ``step()`` (and its background thread when no step comes); a
tree used on its own at every insert and match.

Between the two the nodes are on the device and locked (never evicted), with no host copy:
``check_integrity`` accepts that only for a queued op.

On a hybrid (SWA) tree a backup also copies the SWA rows its tokens still hold on the
device and have no host copy of yet (a node may have adopted host copies of some: those are
kept); the step's SWA host pool is made room for in the same way. Write-back evictions
(:meth:`~hicache.radix.tiers.TieredRadixTree.evict`) allocate at once: the device slots they
free wait for that write.

Plain functions of :class:`~hicache.radix.tiers.TieredRadixTree`, on the scheduler thread
(or under the service lock).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.controller import Direction
from hicache.pools import IndexSpace, Indices

from .key import TOKEN_BYTES
from .node import PendingOp, TreeNode, cat_indices, slice_indices
from .tree import slots_of
from .window_tail import evict_host_swa, make_swa_host_room

if TYPE_CHECKING:
    from .tiers import TieredRadixTree


def queue(tree: TieredRadixTree, nodes: list[TreeNode]) -> None:
    """Queue backups of those of ``nodes`` on the device with no host copy and no op (one
    lock each until the ack). Issued at once when the tree's
    :attr:`~hicache.radix.tiers.TieredRadixTree.issue_backups` is on."""
    todo = [n for n in nodes if n.device is not None and n.host is None
            and n.write_op is None and n.load_op is None]
    if not todo:
        return
    # the rows may still be written on the caller's stream: the copy, issued later with
    # another stream current (or on the service's thread), waits for it
    mark = tree.io.mark_caller()
    marks = () if mark is None else (mark,)
    for node in todo:  # one op each: the host may have room for some of them only
        node.write_op = PendingOp(Direction.DEVICE_TO_HOST, [node], [node], queued=True,
                                  marks=marks)
        tree.lock(node)
        tree.queued_backups.append(node.write_op)
    if tree.issue_backups:
        issue_queued(tree)
    elif tree.on_backup_queued is not None:
        tree.on_backup_queued()


def issue_queued(tree: TieredRadixTree, evict: bool = True) -> None:
    """Allocate host slots for every backup queued since the last call and queue their
    copies as one controller write, then issue the controller's queued writes. When the
    host cannot take them all, even after evicting host leaves, as many as fit go (one op
    each, in the order queued) and the rest are refused: counted in
    ``stats.refused_backups["host_full"]``, their nodes unlocked and left without a copy.

    ``evict=False`` (the service's background thread): nothing is evicted, so no node
    leaves the tree between an engine's ``match`` and its ``lock``; backups that do not fit
    as they are stay queued for the scheduler's next step."""
    ops, tree.queued_backups = tree.queued_backups, []
    if ops:
        try:
            _issue(tree, ops, evict)
        except BaseException:
            # the write that raised (an observer's exception, a Ctrl-C) was cancelled: the
            # ops not written or refused go back to the queue, to be issued at a later call
            tree.queued_backups = [op for op in ops if op.queued and op.nodes[0].write_op is op
                                   ] + tree.queued_backups
            raise
    tree.controller.start_writing()


def _issue(tree: TieredRadixTree, ops: list[PendingOp], evict: bool) -> None:
    """:func:`issue_queued` of ``ops``, taken off the tree's queue."""
    nodes = ops[0].nodes if len(ops) == 1 else [node for op in ops for node in op.nodes]
    short = sum([len(node.key) for node in nodes]) // TOKEN_BYTES - tree.io.host_free_tokens()
    if short > 0 and evict:
        tree.evict_host(short)
    batch = ops[0] if len(ops) == 1 else PendingOp(
        Direction.DEVICE_TO_HOST, nodes, [lock for op in ops for lock in op.locks],
        marks=tuple(mark for op in ops for mark in op.marks))  # shared: waited once
    if not evict:
        if short > 0 or not _write(tree, batch):
            tree.queued_backups = ops + tree.queued_backups  # for the step, which evicts
    elif not _write(tree, batch) and not (
            _room_for_swa(tree, batch) and _write(tree, batch)):
        for op in ops:  # the host cannot take them all: as many as fit
            if len(ops) == 1 or not _write(tree, op):
                _refuse(tree, op)


def _write(tree: TieredRadixTree, op: PendingOp) -> bool:
    """Allocate host slots for the nodes of queued ``op`` and queue their copy (tagged
    with ``op``); False, with nothing changed, when the host is full."""
    nodes = op.nodes
    device = cat_indices([slots_of(node, "device") for node in nodes], IndexSpace.DEVICE_FULL)
    slots = tree.io.backup(device, op, _host_swa(tree, nodes), marks=op.marks)
    if slots is None:
        return False
    host, host_swa = slots
    at, one = 0, len(nodes) == 1
    for node in nodes:
        end = at + node.num_tokens
        node.host = host if one else slice_indices(host, at, end)
        if host_swa is not None:
            node.host_swa = host_swa if one else slice_indices(host_swa, at, end)
        node.write_op = op
        at = end
    op.queued, op.marks = False, ()
    return True


def _host_swa(tree: TieredRadixTree, nodes: list[TreeNode]) -> Indices | None:
    """The host SWA copies ``nodes`` already have, aligned with their tokens (0 = none);
    ``None`` when none has any (and always without SWA layers)."""
    if not tree.io.is_hybrid or not any(node.host_swa is not None for node in nodes):
        return None
    if len(nodes) == 1:
        return nodes[0].host_swa
    return cat_indices([node.host_swa if node.host_swa is not None else Indices(
        torch.zeros(node.num_tokens, dtype=torch.int64), IndexSpace.HOST_SWA)
        for node in nodes], IndexSpace.HOST_SWA)


def _room_for_swa(tree: TieredRadixTree, op: PendingOp) -> bool:
    """Make room in the SWA host pool for the SWA rows of ``op``'s nodes that need a copy
    (a hybrid tree whose write of ``op`` was refused for SWA room, the full host having
    been made room for): host-only leaves first, whole, as a single backup does (every
    cached prefix stays reusable), then SWA copies on their own; True when any were freed."""
    if not tree.io.is_hybrid:
        return False
    device = cat_indices([slots_of(node, "device") for node in op.nodes],
                         IndexSpace.DEVICE_FULL)
    swa = tree.io.swa_of(device)
    assert swa is not None, "a hybrid tree maps every device slot"
    needed = swa.tensor != 0
    have = _host_swa(tree, op.nodes)
    if have is not None:
        needed &= have.tensor == 0
    needed_tokens = int(needed.sum())
    return make_swa_host_room(tree, needed_tokens,
                              needed_tokens - tree.io.host_swa_free_tokens())


def _refuse(tree: TieredRadixTree, op: PendingOp) -> None:
    """Give up queued ``op``: its nodes keep their device slots only, its locks drop."""
    for node in op.nodes:
        node.write_op = None
        tree._touch(node)
    for node in op.locks:
        tree.unlock(node)
    tree.stats.refused_backups["host_full"] += sum(node.num_tokens for node in op.nodes)


def allocate_one(tree: TieredRadixTree, node: TreeNode, *, evict_after: bool) -> bool | None:
    """Allocate host slots for ``node`` and queue its backup now (the caller issues it with
    ``start_writing``); on a full host evict host leaves and retry once. False (counted)
    when there is no room; ``None`` (not counted) when the host leaves evicted for it are
    only queued for the shared store (its ``write_back``: they leave once stored), so room
    is on its way and the caller keeps ``node`` for a later eviction (evicting more host
    leaves meanwhile would send twice the pages needed to the store, and dropping ``node``
    would lose a prefix no tier holds). ``evict_after``: a write-back eviction (the node is
    flagged to leave the device at the ack) rather than a locked write-through backup."""
    op = PendingOp(Direction.DEVICE_TO_HOST, [node], [])
    device = slots_of(node, "device")
    # A host short of room evicts first: a write refused for room would have run
    # every check of the device pages for nothing
    tree.host_tokens_scheduled = 0
    evicted = tree.io.host_free_tokens() < node.num_tokens and \
        tree.evict_host(node.num_tokens) > 0
    waiting = tree.host_tokens_scheduled > 0  # host leaves leave once the store has them
    slots = tree.io.backup(device, op, node.host_swa)
    if slots is None and waiting:
        return None  # room is on its way: the caller keeps the node for a later eviction
    if slots is None and not evicted and tree.evict_host(node.num_tokens) > 0:
        slots = tree.io.backup(device, op, node.host_swa)
    if slots is None and tree.io.is_hybrid and \
            evict_host_swa(tree, node.num_tokens - tree.io.host_swa_free_tokens()) > 0:
        slots = tree.io.backup(device, op, node.host_swa)  # the SWA host pool was short
    if slots is None:
        tree.stats.refused_backups["host_full"] += node.num_tokens
        return False
    node.host, node.host_swa = slots
    node.write_op = op
    if evict_after:
        node.evict_on_ack = True
    else:
        op.locks.append(node)
        tree.lock(node)
    return True
