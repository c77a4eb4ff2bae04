"""Load-backs: a cached prefix's host-only run brought back to the device.

A match is a device prefix followed by a host-only run (:class:`~hicache.radix.MatchResult`).
:func:`load_back` queues one host-to-device op for the host-only ancestors of a node (the
span), all or nothing; the controller issues it at ``start_loading``. The span's nodes own
their new device slots at once and wait for the op (``load_op``); the node stays locked
until the ack (``TieredRadixTree._finish_load``). For a hybrid model the same op restores
the SWA rows of the window that lie in the device prefix
(:func:`~hicache.radix.window_tail.window_restore`). The result (:class:`LoadBack`) says
what was queued or why not; a refusal is also counted in ``CacheStats.refused_load_backs``.

Plain functions of :class:`~hicache.radix.HiRadixCache` (its ``load_back`` calls
:func:`load_back`), on the scheduler thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hicache.controller import Direction
from hicache.pools import IndexSpace, Indices
from hicache.pools.serial_copies import int64_copy

from .node import LoadBack, PendingOp, Refusal, TreeNode, cat_indices, empty_indices, slice_indices
from .node_io import SlotPair
from .tree import slots_of
from .window_tail import window_restore

if TYPE_CHECKING:
    from .cache import HiRadixCache

logger = logging.getLogger(__name__)


def load_back(tree: HiRadixCache, node: TreeNode, device_quota_tokens: int) -> LoadBack:
    """See :meth:`HiRadixCache.load_back`."""
    span = host_span(tree, node)
    num_tokens = sum(n.num_tokens for n in span)
    restore = window_restore(tree, node, num_tokens)
    if restore is None:
        return refuse(tree, Refusal.SWA_TAIL_MISSING, num_tokens)
    if not span and not restore.nodes:
        return LoadBack(empty_indices(IndexSpace.DEVICE_FULL), None, 0)
    if span and num_tokens < tree.load_back_threshold_tokens:
        return refuse(tree, Refusal.BELOW_THRESHOLD, num_tokens)
    if num_tokens > device_quota_tokens:
        return refuse(tree, Refusal.OVER_QUOTA, num_tokens)
    host = cat_indices([slots_of(n, "host") for n in span], IndexSpace.HOST_FULL)
    host_swa = (cat_indices([slots_of(n, "host_swa") for n in span], IndexSpace.HOST_SWA)
                if tree.io.is_hybrid else None)
    if not tree.io.tail_has_swa(host_swa):
        return refuse(tree, Refusal.SWA_TAIL_MISSING, num_tokens)
    op = PendingOp(Direction.HOST_TO_DEVICE, list(span), [node])
    tree.lock(node)  # held until the ack; also shields the span while we evict
    try:
        loaded = tree.io.load(host, host_swa, op, restore.slots)
        if loaded is None:
            tree.evict_swa(restore.num_tokens + tree.io.tail_tokens)
            tree.evict(num_tokens)
            loaded = tree.io.load(host, host_swa, op, restore.slots)
    except BaseException:  # the load that raised was cancelled (an observer's, a Ctrl-C)
        tree.unlock(node)
        raise
    if loaded is None:
        tree.unlock(node)
        return refuse(tree, Refusal.DEVICE_FULL, num_tokens)
    assign_loaded(tree, span, loaded, op)
    restore.assign(tree, op)
    tree.stats.loaded_back_tokens += num_tokens
    # the engine's own copy: the op (and a node of a one-node span) read the loaded tensor
    device = Indices(int64_copy(loaded[0].tensor), IndexSpace.DEVICE_FULL)
    return LoadBack(device, None, num_tokens, restore.num_tokens)


def host_span(tree: HiRadixCache, node: TreeNode) -> list[TreeNode]:
    """The host-only ancestors of ``node`` (itself included), root side first, down from
    the first device-resident one."""
    span = []
    for ancestor in tree._ancestry(node, "load_back"):
        if ancestor.on_device:
            break
        assert ancestor.is_backed_up, f"host-only {ancestor!r} has no complete host copy"
        span.append(ancestor)
    span.reverse()
    return span


def assign_loaded(
    tree: HiRadixCache, span: list[TreeNode], loaded: SlotPair, op: PendingOp
) -> None:
    """Give the span's nodes their slices of the ``loaded`` slots; they wait for ``op``. A
    span of one node takes the loaded tensors themselves, which the op reads too (neither
    changes them in place; the engine gets a copy)."""
    device, device_swa = loaded
    now, offset = tree._clock(), 0
    whole = len(span) == 1 and len(device) == span[0].num_tokens
    for node in span:
        end = offset + node.num_tokens
        node.device = device if whole else slice_indices(device, offset, end)
        node.device_swa = (None if device_swa is None else device_swa if whole
                           else slice_indices(device_swa, offset, end))
        node.load_op, node.last_access, offset = op, now, end
        tree._touch(node)


def refuse(tree: HiRadixCache, reason: Refusal, num_tokens: int) -> LoadBack:
    """Count a refused load-back and say why."""
    tree.stats.refused_load_backs[reason.value] += num_tokens
    logger.debug("load-back of %d tokens refused: %s", num_tokens, reason.value)
    return LoadBack(empty_indices(IndexSpace.DEVICE_FULL), reason, num_tokens)
