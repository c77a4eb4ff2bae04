"""The shape of the radix tree: page-aligned keys, descent, splits, removal and locks.

Keys are token ids of whole pages held as bytes (``TOKEN_BYTES`` per token, see
:func:`~hicache.radix.key.key_bytes`): compact, compared in C, sliced at page boundaries.
A node's children are keyed by their first page, so two children never share one.
:class:`RadixTree` knows nothing of tiers or the controller; :class:`hicache.radix.HiRadixCache`
builds on it.

Thread ownership: the engine's scheduler thread is the only caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

from hicache.pools import IndexSpace, Indices
from hicache.storage.keys import PAGE_HASH_BYTES

from .key import TOKEN_BYTES, TokenIds, TokenKey, make_key, token_ids
from .node import SLOT_FIELDS, MatchResult, TreeNode, cat_indices, slice_indices

Clock = Callable[[], float]
_tree_ids = itertools.count(1)  # process-wide, so nodes of two trees never share an id


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
        self._page_bytes = page_size * TOKEN_BYTES  # one page of a key
        ticks = itertools.count(1)
        self._clock: Clock = clock if clock is not None else lambda: float(next(ticks))
        self._node_ids = itertools.count(1)
        self.tree_id = next(_tree_ids)
        self.root = TreeNode(0, b"", None, self.tree_id)
        self.num_nodes = 0  # attached nodes, the root excluded
        # Nodes whose eviction state or key may have changed since the last eviction (an
        # ordered set); the tiers drain it into their candidate heaps.
        self._touched: dict[TreeNode, None] = {}

    def key(self, tokens: TokenIds | TokenKey, op: str = "key") -> TokenKey:
        """``tokens`` checked once, for every later call of the same request (see
        :class:`~hicache.radix.key.TokenKey`); a key of this tree is returned as is.

        Raises:
            TypeError: not token ids (see :func:`~hicache.radix.key.token_ids`).
            ValueError: a negative token id; a key made for another page size.
        """
        if isinstance(tokens, TokenKey):
            self._check_key(tokens, op)
            return tokens
        return make_key(tokens, self.page_size, op)

    def page_key(self, tokens: TokenIds | TokenKey, op: str = "page_key") -> tuple[int, ...]:
        """``tokens`` truncated to whole pages, as a tuple of Python ints (a
        :class:`~hicache.radix.key.TokenKey` gives its pages unchecked); every raw token is
        checked, the partial tail page too, before anything changes; errors as for :meth:`key`."""
        if isinstance(tokens, TokenKey):
            self._check_key(tokens, op)
            return tokens.pages
        ids = token_ids(tokens, op)
        return ids[:len(ids) // self.page_size * self.page_size]

    def key_data(self, tokens: TokenIds | TokenKey, op: str) -> bytes:
        """The whole pages of ``tokens`` as key bytes (a :class:`TokenKey` gives its own);
        checked as :meth:`page_key`."""
        if isinstance(tokens, TokenKey):
            self._check_key(tokens, op)
            return tokens.data
        return make_key(tokens, self.page_size, op).data  # checked and packed once

    def _check_key(self, key: TokenKey, op: str) -> None:
        if key.page_size != self.page_size:
            raise ValueError(f"{op}: a TokenKey made for pages of {key.page_size} tokens, this "
                             f"cache's pages have {self.page_size}; make the key with its key()")

    def nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def device_prefix(self, tokens: TokenIds | TokenKey) -> Indices:
        """``DEVICE_FULL`` slots of the device-resident prefix of ``tokens`` (no side effect)."""
        parts = []
        for node, used in self._descend(self.key_data(tokens, "device_prefix"), split=False):
            if node.device is None:
                break
            parts.append(slice_indices(node.device, 0, used))
        return cat_indices(parts, IndexSpace.DEVICE_FULL)

    def device_prefix_pages(self, tokens: TokenIds | TokenKey) -> np.ndarray:
        """Page ids of :meth:`device_prefix` (int64), read off the nodes' slots (no copy)."""
        page = self.page_size
        parts = [slots[::page] for slots in self.device_prefix_views(tokens, "device_prefix")]
        return np.concatenate(parts) // page if parts else np.empty(0, dtype=np.int64)

    def device_prefix_views(self, tokens: TokenIds | TokenKey, op: str) -> list[np.ndarray]:
        """The slots of :meth:`device_prefix`, node by node: numpy views of the nodes' own
        int64 slots (no copy), to read at once and never write."""
        views = []
        for node, used in self._descend(self.key_data(tokens, op), split=False):
            if node.device is None:
                break
            views.append(node.device.tensor.numpy()[:used])
        return views

    # ---- locks --------------------------------------------------------------------------

    def lock(self, node: TreeNode, *, caller: bool = False) -> None:
        """Protect ``node`` and its ancestors from eviction (the root is a no-op).
        ``caller``: the engine's lock (``service.lock``), counted apart on ``node`` so that
        its release cannot take a lock the cache holds for an op in flight.

        Raises:
            TypeError: ``node`` is not a :class:`TreeNode`.
            ValueError: ``node`` belongs to another tree, or was removed from this one.
        """
        self._check_node(node, "lock")
        current: TreeNode | None = node  # a loop: a generator would cost a call per node
        while current is not None and current is not self.root:
            current.lock_count += 1
            current = current.parent
        if caller:
            node.caller_locks += 1

    def unlock(self, node: TreeNode, *, op: str = "unlock", caller: bool = False) -> None:
        """Release one :meth:`lock` of ``node`` (``caller``: one the engine took); raises
        ``RuntimeError`` if not locked so, and as :meth:`lock` for a node that is not a live
        node of this tree. ``op``: the caller's name, for error messages."""
        self._check_node(node, op)
        if caller and node.caller_locks <= 0:
            raise RuntimeError(f"{op}: {node!r} is not locked by the engine: release only "
                               f"what lock() took (the cache releases its own locks of "
                               f"load-backs, backups and prefetches when they finish)")
        root = self.root  # locks propagate: no ancestor has fewer than the node (or root)
        if node.lock_count <= 0 and node is not root:
            raise RuntimeError(f"{op}: {node!r} is not locked (unbalanced {op})")
        if caller:
            node.caller_locks -= 1
        current: TreeNode | None = node
        while current is not None and current is not root:
            current.lock_count -= 1
            if current.lock_count == 0:
                self._touched[current] = None  # _touch, inlined
            current = current.parent

    # ---- shape --------------------------------------------------------------------------

    def _descend(self, key: bytes, split: bool) -> list[tuple[TreeNode, int]]:
        """Matched nodes along ``key`` (bytes) with the tokens used of each (whole nodes if
        split)."""
        node, pos, path, step, end = self.root, 0, [], self._page_bytes, len(key)
        while pos < end:
            child = node.children.get(key[pos:pos + step])
            if child is None:
                break
            common = self._common_bytes(child.key, key, pos)
            if common < len(child.key) and split:
                child = self._split(child, common // TOKEN_BYTES)
            path.append((child, common // TOKEN_BYTES))
            if common < len(child.key):
                break
            pos, node = pos + common, child
        return path

    def _common_bytes(self, node_key: bytes, key: bytes, pos: int) -> int:
        """Whole-page length, in bytes, of the common prefix of ``node_key`` and ``key[pos:]``.

        Compares bytes in C: the whole overlap first, which is the usual answer (the whole
        node with ``startswith``, which copies no slice), then a binary search over the
        number of equal leading pages."""
        page, size = self._page_bytes, len(node_key)
        limit = min(size, len(key) - pos)
        limit -= limit % page
        if key.startswith(node_key, pos) if limit == size else \
                node_key[:limit] == key[pos:pos + limit]:
            return limit
        equal, unequal = 0, limit // page  # pages known equal, pages known not all equal
        while unequal - equal > 1:
            middle = (equal + unequal) // 2
            if node_key[:middle * page] == key[pos:pos + middle * page]:
                equal = middle
            else:
                unequal = middle
        return equal * page

    def _split(self, node: TreeNode, num_tokens: int) -> TreeNode:
        """Cut ``node`` after ``num_tokens`` (a page multiple) and return the new upper node.

        Every slot array is sliced at the same offset, so device, host and SWA slots stay
        aligned. The upper node inherits the lock count (locks propagate through it), hit
        count, access time and flags, and joins any op in flight on ``node``.
        """
        parent = node.parent
        assert parent is not None and 0 < num_tokens < node.num_tokens, "bad split"
        upper = TreeNode(
            next(self._node_ids), node.key[:num_tokens * TOKEN_BYTES], parent, self.tree_id,
            lock_count=node.lock_count, hit_count=node.hit_count, last_access=node.last_access,
            write_op=node.write_op, load_op=node.load_op, evict_on_ack=node.evict_on_ack,
        )
        for name in SLOT_FIELDS:
            value: Indices | None = getattr(node, name)
            if value is not None:
                setattr(upper, name, slice_indices(value, 0, num_tokens))
                setattr(node, name, slice_indices(value, num_tokens, len(value)))
        for op in (node.write_op, node.load_op):
            if op is not None:
                op.nodes.append(upper)
        upper.store_op, upper.in_storage = node.store_op, node.in_storage
        if node.store_op is not None:
            node.store_op.nodes.append(upper)
        if node.page_hashes is not None:
            cut = num_tokens // self.page_size * PAGE_HASH_BYTES
            upper.page_hashes, node.page_hashes = node.page_hashes[:cut], node.page_hashes[cut:]
        node.key, node.parent = node.key[num_tokens * TOKEN_BYTES:], upper
        upper.children[node.key[:self._page_bytes]] = node
        parent.children[upper.key[:self._page_bytes]] = upper
        self.num_nodes += 1
        self._touch(upper)
        return upper

    def _new_child(self, parent: TreeNode, key: bytes, device: Indices | None) -> TreeNode:
        child = TreeNode(next(self._node_ids), key, parent, self.tree_id, device=device)
        parent.children[key[:self._page_bytes]] = child
        self.num_nodes += 1
        self._touch(child)
        return child

    def _detach(self, node: TreeNode) -> None:
        """Remove ``node`` and its subtree from the tree (their slots must be freed; the
        caller offers the parent, which may have become a leaf, to the eviction heaps)."""
        assert node.parent is not None, "cannot detach the root"
        del node.parent.children[node.key[:self._page_bytes]]
        for gone in subtree(node) if node.children else (node,):  # a leaf: no generator
            gone.is_detached = True
            self.num_nodes -= 1

    def _touch(self, node: TreeNode) -> None:
        """Note that ``node`` may have become evictable or changed its eviction key; O(1)."""
        self._touched[node] = None

    def _ancestry(self, node: TreeNode, op: str) -> list[TreeNode]:
        """``node`` and its ancestors below the root, once :meth:`_check_node` passed."""
        self._check_node(node, op)
        chain: list[TreeNode] = []
        current: TreeNode | None = node
        while current is not None and current is not self.root:
            chain.append(current)
            current = current.parent
        return chain

    def _check_node(self, node: object, op: str) -> None:
        """Refuse anything but a live node of this tree; O(1)."""
        if not isinstance(node, TreeNode):
            hint = ("; pass its last_device_node (or last_host_node)"
                    if isinstance(node, MatchResult) else "")
            raise TypeError(
                f"{op}: expected a TreeNode of this cache (MatchResult.last_device_node or "
                f"last_host_node from its match()), got {type(node).__name__}{hint}"
            )
        if node.tree_id != self.tree_id:
            raise ValueError(
                f"{op}: {node!r} belongs to another cache (tree {node.tree_id}, not "
                f"{self.tree_id}); pass a node from this cache's own match()"
            )
        if node.is_detached:
            raise ValueError(
                f"{op}: {node!r} was removed from the tree (evicted or dropped); match() "
                f"again for a live node"
            )


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
