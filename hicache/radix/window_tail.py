"""The sliding window's side of the tree (hybrid models, ``host.swa_history: all``): SWA
rows follow the full rows to the host, so any cached prefix can be reused.

A prefix of ``P`` tokens is reusable by SWA layers only if the last window of it (the tree's
``tail_tokens``) has SWA rows on the device. Those rows may have left the device (the engine
frees them as a running request moves past them; :func:`evict_swa` frees them under SWA
pool pressure) as long as they have a host copy: :func:`window_restore` finds which tokens of
the window lie in the device prefix without SWA rows and a load-back brings their SWA rows
back in the same op that loads the host span (``restore``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from hicache.controller import Direction
from hicache.pools import IndexSpace, Indices

from .node import PendingOp, TreeNode, cat_indices, slice_indices
from .node_io import SlotPair
from .tree import slots_of
from .window_backups import WindowBackupOp

if TYPE_CHECKING:
    from .cache import HiRadixCache
    from .eviction import CandidateHeap
    from .tiers import TieredRadixTree


@dataclass
class WindowRestore:
    """Device-prefix tokens of a load-back's window whose SWA rows come back from the host:
    ``nodes``, and per node the full slots and host SWA slots of those tokens."""

    nodes: list[TreeNode] = field(default_factory=list)
    full: list[Indices] = field(default_factory=list)
    host_swa: list[Indices] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(part) for part in self.full)

    @property
    def slots(self) -> SlotPair | None:
        if not self.nodes:
            return None
        return (cat_indices(self.full, IndexSpace.DEVICE_FULL),
                cat_indices(self.host_swa, IndexSpace.HOST_SWA))

    def assign(self, tree: HiRadixCache, op: PendingOp) -> None:
        """The restored nodes' SWA slots are in the pool's map now; they wait for ``op``.

        A node whose own load-back is still in flight waits for ``op`` instead: loads are
        acknowledged in the order they were queued, so ``op``'s ack comes last."""
        for node in self.nodes:
            node.device_swa = tree.io.swa_of(slots_of(node, "device"))
            if node.load_op is not None:
                node.load_op.nodes.remove(node)
            node.load_op = op
            op.nodes.append(node)
        tree.stats.restored_swa_tokens += self.num_tokens


def window_restore(tree: HiRadixCache, node: TreeNode, span_tokens: int) -> WindowRestore | None:
    """What a load-back down to ``node`` (whose host-only span is ``span_tokens`` long) must
    restore in the device prefix; ``None`` when a token of the window has SWA rows on
    neither tier (the prefix cannot be reused)."""
    restore = WindowRestore()
    need = tree.io.tail_tokens - span_tokens
    if need <= 0 or not tree.io.keeps_swa_history:
        return restore
    device_nodes = [n for n in tree._ancestry(node, "load_back") if n.on_device]
    for ancestor in device_nodes:  # deepest first
        take = min(need, ancestor.num_tokens)
        start = ancestor.num_tokens - take
        device = slots_of(ancestor, "device")
        swa = tree.io.swa_of(device)
        assert swa is not None, "a hybrid tree maps every device slot"
        missing = swa.tensor[start:] == 0
        if bool(missing.any()):
            host = ancestor.host_swa
            if host is None or bool((host.tensor[start:][missing] == 0).any()):
                return None
            restore.nodes.append(ancestor)
            restore.full.append(Indices(device.tensor[start:][missing], IndexSpace.DEVICE_FULL))
            restore.host_swa.append(Indices(host.tensor[start:][missing].to(torch.int64),
                                            IndexSpace.HOST_SWA))
        need -= take
        if need <= 0:
            break
    return restore


def back_up_window(tree: HiRadixCache, device: Indices) -> None:
    """See :meth:`HiRadixCache.back_up_window`."""
    if not tree.io.keeps_swa_history:
        tree.io.release_swa(device)
        return
    # The op's own copy: its ack releases these pages' SWA slots, and the engine may
    # reuse its tensor as soon as this call returns.
    device = Indices(device.tensor.clone(), device.space)
    op = WindowBackupOp(Direction.DEVICE_TO_HOST, [], [], device=device)
    needed = _room_for_window(tree, device)
    host_swa = tree.io.write_swa(device, op)
    if host_swa is None:  # the tokens with rows to copy (a page without them is skipped)
        tree.stats.refused_backups["host_swa_full"] += needed
        tree.io.release_swa(device)
        return
    if not bool((host_swa.tensor != 0).any()):
        return  # no page had SWA rows left: nothing was queued
    tree.window_backups.add(device, host_swa, op)
    tree.stats.window_backup_tokens += int((host_swa.tensor != 0).sum())
    if tree.issue_backups:  # else the copy joins the step's write (one op for the step)
        tree.controller.start_writing()


def _room_for_window(tree: HiRadixCache, device: Indices) -> int:
    """Free SWA host room for the window backup of ``device`` before it is tried (a refused
    try costs every check of the write): host-only leaves first, for what is short, then
    SWA copies on their own, as :func:`evict_host_swa` explains. Nothing when the pool
    already has room. Returns the tokens of ``device`` with SWA rows (what it copies)."""
    swa = tree.io.swa_of(device)
    needed = int(torch.count_nonzero(swa.tensor)) if swa is not None else 0
    free = tree.io.host_swa_free_tokens()
    if free < needed:
        make_swa_host_room(tree, needed, needed - free)
    return needed


def make_swa_host_room(tree: TieredRadixTree, needed: int, host_tokens: int) -> bool:
    """Free room in the SWA host pool for ``needed`` tokens of SWA rows: ``host_tokens`` of
    host-only leaves first (whole, so every cached prefix stays reusable), then SWA copies
    on their own (:func:`evict_host_swa`) for what is still short. Nothing when the pool
    has the room already; True when anything was freed."""
    if tree.io.host_swa_free_tokens() >= needed:
        return False
    freed = tree.evict_host(host_tokens) > 0
    short = needed - tree.io.host_swa_free_tokens()
    return (short > 0 and evict_host_swa(tree, short) > 0) or freed


def finish_window_backup(tree: HiRadixCache, op: WindowBackupOp) -> None:
    """The host copy of ``op``'s SWA rows is complete: free their device SWA slots."""
    tree.window_backups.finish(op)
    tree.io.release_swa(op.device)


def refuse_copies_in_flight(tree: HiRadixCache, slots: np.ndarray) -> None:
    """Refuse an insert of engine ``slots`` (int64, one a token) some of whose pages' SWA
    rows :func:`back_up_window` is still copying to the host (the service waits first)."""
    backups = tree.window_backups
    if len(backups) and backups.in_flight(Indices(torch.from_numpy(slots),
                                                   IndexSpace.DEVICE_FULL)):
        raise ValueError("insert: the SWA rows of some of these pages are still being "
                         "copied to the host (back_up_window); apply_acks once the copy "
                         "finished, then insert (the service waits for it by itself)")


def take_swa(tree: HiRadixCache, taken: list[tuple[TreeNode, int]],
             duplicate: Indices | None, num_tokens: int) -> None:
    """The SWA side of an insert (hybrid): the nodes that took the caller's slots (``taken``:
    with their token offset) take their SWA slots and the host SWA copies made of them; the
    copies of ``duplicate`` pages (which the tree freed) are freed. SWA rows before the
    sequence's window are kept (to be backed up with the node, and freed by evict_swa once
    their host copy exists) when the host keeps SWA history, else freed now (an engine that
    calls release_window has freed them already)."""
    if duplicate is not None:
        tree.io.free_host_swa(tree.window_backups.take(duplicate))
    window_start = 0 if tree.io.keeps_swa_history else tree.io.window_start(num_tokens)
    for node, offset in taken:
        device = slots_of(node, "device")
        cut = max(0, min(node.num_tokens, window_start - offset))
        tree.io.release_swa(slice_indices(device, 0, cut))
        node.device_swa = tree.io.swa_of(device)
        adopt_window_backups(tree, node)


def adopt_window_backups(tree: HiRadixCache, node: TreeNode) -> None:
    """Give ``node`` (which just took engine pages) the host SWA copies of its pages.

    A host-only node that takes engine pages again (the engine recomputed its tokens, e.g.
    after a refused load-back) may already have host SWA copies of some of them: it keeps
    its own, and the engine's copies of those tokens (the same rows) are freed."""
    adopted = tree.window_backups.take(slots_of(node, "device"))
    if adopted is None:
        return
    if node.host_swa is None:
        node.host_swa = adopted
        return
    have = node.host_swa.tensor != 0
    tree.io.free_host_swa(Indices(adopted.tensor[have], IndexSpace.HOST_SWA))
    node.host_swa = Indices(torch.where(have, node.host_swa.tensor.to(torch.int64),
                                         adopted.tensor), IndexSpace.HOST_SWA)


def evict_swa(tree: HiRadixCache, num_tokens: int) -> int:
    """See :meth:`HiRadixCache.evict_swa`: candidates in the tree's eviction order, from
    their own heap (costs per node it looks at and per change since the last eviction)."""
    if not tree.io.keeps_swa_history or num_tokens <= 0:
        return 0
    freed = _evict_each(tree, tree._swa_candidates, num_tokens, _free_device_swa)
    tree.stats.evicted_swa_tokens += freed
    return freed


def evict_host_swa(tree: TieredRadixTree, num_tokens: int) -> int:
    """Free host SWA copies on their own, in the tree's eviction order, until
    ``num_tokens`` are free. A node that loses them keeps its full rows on every tier:
    longer prefixes through it stay reusable, a prefix whose window ends in it no longer
    is. So callers first evict host-only leaves whole (``evict_host``, which keeps every
    cached prefix reusable: on the randomized hybrid run, SWA-only eviction first raised
    the ``swa_tail_missing`` refusals from 0 to 1-6% of host hits) and come here only when
    that frees too little (the SWA host pool is held by nodes still on the device, or by
    window backups of running requests). Returns tokens freed."""
    if not tree.io.is_hybrid or num_tokens <= 0:
        return 0
    freed = _evict_each(tree, tree._host_swa_candidates, num_tokens, _free_host_swa)
    tree.stats.evicted_host_swa_tokens += freed
    return freed


def _evict_each(tree: TieredRadixTree, heap: CandidateHeap, num_tokens: int,
                free: Callable[[TieredRadixTree, TreeNode], int]) -> int:
    """Pop ``heap``'s candidates (after the tree's changes reach it) and ``free`` each,
    until ``num_tokens`` are freed or none is left; the tokens freed."""
    tree._refresh_candidates()
    freed = 0
    while freed < num_tokens:
        node = heap.pop()
        if node is None:
            break
        freed += free(tree, node)
    return freed


def _free_device_swa(tree: TieredRadixTree, node: TreeNode) -> int:
    """Free the device SWA rows of ``node`` that have a host copy; how many."""
    device = slots_of(node, "device")
    swa = tree.io.swa_of(device)
    assert swa is not None and node.host_swa is not None
    # whole pages whose every token has both (release_swa frees pages by id)
    backed = ((swa.tensor != 0) & (node.host_swa.tensor != 0)).view(-1, tree.page_size)
    pages = backed.all(dim=1)
    if not bool(pages.any()):
        return 0
    freed = device.tensor.reshape(-1, tree.page_size)[pages].reshape(-1)
    tree.io.release_swa(Indices(freed, IndexSpace.DEVICE_FULL))
    node.device_swa = tree.io.swa_of(device)
    return int(freed.numel())


def _free_host_swa(tree: TieredRadixTree, node: TreeNode) -> int:
    """Free the host SWA copies of ``node``; how many. A host copy of the full rows keeps
    aligned (all 0) SWA host slots."""
    host_swa = node.host_swa
    assert host_swa is not None
    kept = int((host_swa.tensor != 0).sum())
    if kept:
        tree.io.free_host_swa(host_swa)
        node.host_swa = None if node.host is None else Indices(
            torch.zeros(node.num_tokens, dtype=torch.int64), IndexSpace.HOST_SWA)
    return kept
