"""The shape of the radix tree: page-aligned keys, descent, splits, removal and locks.

Keys are tuples of token ids whose length is a whole number of pages; a node's children
are keyed by their first page, so two children never share one. :class:`RadixTree` knows
nothing of tiers or the controller; :class:`hicache.radix.HiRadixCache` builds on it.

Thread ownership: the engine's scheduler thread is the only caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from hicache.pools import IndexSpace, Indices

from .tree_node import SLOT_FIELDS, TreeNode, cat_indices, slice_indices

Clock = Callable[[], float]


class RadixTree:
    """Nodes over page-aligned token keys, with ancestor-propagated lock counts.

    Args:
        page_size: tokens per page; matching and insertion work in whole pages.
        clock: last-access time source; the default is a counter (deterministic tests).
    """

    def __init__(self, page_size: int, clock: Clock | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        ticks = itertools.count(1)
        self._clock: Clock = clock if clock is not None else lambda: float(next(ticks))
        self._node_ids = itertools.count(1)
        self.root = TreeNode(0, (), None)

    def page_key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """``tokens`` truncated to whole pages, as a tuple of ints."""
        num_tokens = len(tokens) // self.page_size * self.page_size
        return tuple(int(token) for token in tokens[:num_tokens])

    def nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def device_prefix(self, tokens: Sequence[int]) -> Indices:
        """``DEVICE_FULL`` slots of the device-resident prefix of ``tokens``; no side effect
        (no split, no hit, no access time)."""
        parts = []
        for node, used in self._descend(self.page_key(tokens), split=False):
            if node.device is None:
                break
            parts.append(slice_indices(node.device, 0, used))
        return cat_indices(parts, IndexSpace.DEVICE_FULL)

    # ---- locks --------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (the root is a no-op)."""
        for ancestor in self._ancestry(node, "lock"):
            ancestor.lock_count += 1

    def unlock(self, node: TreeNode) -> None:
        """Release one :meth:`lock` of ``node``; raises ``RuntimeError`` if not locked."""
        chain = list(self._ancestry(node, "unlock"))
        if any(ancestor.lock_count <= 0 for ancestor in chain):
            raise RuntimeError(f"unlock of {node!r}, which is not locked (unbalanced unlock)")
        for ancestor in chain:
            ancestor.lock_count -= 1

    # ---- shape --------------------------------------------------------------------------

    def _descend(self, key: tuple[int, ...], split: bool) -> list[tuple[TreeNode, int]]:
        """Matched nodes along ``key`` with the tokens used of each (whole nodes if split)."""
        node, pos, path = self.root, 0, []
        while pos < len(key):
            child = node.children.get(key[pos:pos + self.page_size])
            if child is None:
                break
            common = self._common_tokens(child.key, key, pos)
            if common < child.num_tokens and split:
                child = self._split(child, common)
            path.append((child, common))
            if common < child.num_tokens:
                break
            pos, node = pos + common, child
        return path

    def _common_tokens(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Whole-page length of the common prefix of ``node_key`` and ``key[pos:]``."""
        limit = min(len(node_key), len(key) - pos)
        i = 0
        while i < limit and node_key[i] == key[pos + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, node: TreeNode, num_tokens: int) -> TreeNode:
        """Cut ``node`` after ``num_tokens`` (a page multiple) and return the new upper node.

        Every slot array is sliced at the same offset, so device, host and SWA slots stay
        aligned. The upper node inherits the lock count (locks propagate through it), hit
        count, access time and flags, and joins any op in flight on ``node``.
        """
        parent = node.parent
        assert parent is not None and 0 < num_tokens < node.num_tokens, "bad split"
        upper = TreeNode(
            next(self._node_ids), node.key[:num_tokens], parent, lock_count=node.lock_count,
            hit_count=node.hit_count, last_access=node.last_access, write_op=node.write_op,
            load_op=node.load_op, evict_on_ack=node.evict_on_ack,
        )
        for name in SLOT_FIELDS:
            value: Indices | None = getattr(node, name)
            if value is not None:
                setattr(upper, name, slice_indices(value, 0, num_tokens))
                setattr(node, name, slice_indices(value, num_tokens, len(value)))
        for op in (node.write_op, node.load_op):
            if op is not None:
                op.nodes.append(upper)
        node.key, node.parent = node.key[num_tokens:], upper
        upper.children[node.key[:self.page_size]] = node
        parent.children[upper.key[:self.page_size]] = upper
        return upper

    def _new_child(self, parent: TreeNode, key: tuple[int, ...], device: Indices) -> TreeNode:
        child = TreeNode(next(self._node_ids), key, parent, device=device)
        parent.children[key[:self.page_size]] = child
        return child

    def _detach(self, node: TreeNode) -> None:
        """Remove ``node`` and its subtree from the tree (their slots must be freed)."""
        assert node.parent is not None, "cannot detach the root"
        del node.parent.children[node.key[:self.page_size]]
        for gone in subtree(node):
            gone.is_detached = True

    def _ancestry(self, node: TreeNode, op: str) -> Iterator[TreeNode]:
        """``node`` and its ancestors below the root; raises if ``node`` was removed."""
        if node.is_detached:
            raise ValueError(f"{op}: {node!r} was removed from the tree")
        current: TreeNode | None = node
        while current is not None and current is not self.root:
            yield current
            current = current.parent


def slots_of(node: TreeNode, name: str) -> Indices:
    """The ``name`` slot field of ``node``, which must be set."""
    value: Indices | None = getattr(node, name)
    assert value is not None, f"{node!r} has no {name} slots"
    return value


def subtree(node: TreeNode) -> Iterator[TreeNode]:
    """``node`` and all its descendants, parents first."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.children.values())
