"""Page hashes of tree nodes: the chain of :func:`hicache.storage.chain_page_hashes` along
the tree's keys, computed once per node and kept on it (``TreeNode.page_hashes``, 32 bytes
per page; a split cuts them at its page).

A node's hashes need its parent's last hash, so a node without them gets them after its
ancestors that lack them, root side first. Scheduler thread only (nodes are the tree's),
but for :func:`key_page_hashes`, a function of its arguments that a prefetch's worker calls.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

import numpy as np

from hicache.radix.key import TOKEN_BYTES
from hicache.storage.keys import PAGE_HASH_BYTES, ROOT_HASH, chain_page_hashes

if TYPE_CHECKING:
    from hicache.radix import RadixTree, TreeNode

_KEY_DTYPE = np.dtype(f"=i{TOKEN_BYTES}")  # how the tree packs token ids


def key_page_hashes(key: bytes, page_size: int, parent: bytes) -> bytes:
    """The hashes of the whole pages of ``key`` (tree key bytes) after the page whose hash
    is ``parent`` (:data:`ROOT_HASH` at a sequence's start), joined."""
    tokens = np.frombuffer(key, dtype=_KEY_DTYPE)
    return b"".join(chain_page_hashes(tokens, page_size, parent=parent))


class HashedTail(Protocol):
    """Key bytes after the page ``parent`` and their pages' hashes, joined: ``None`` until
    computed (by another thread, which sets them once)."""

    tail: bytes
    parent: bytes
    joined: bytes | None


class RecentHashes:
    """The page hashes of recent prefetches' tails (:class:`HashedTail`: a prefetch's job,
    whose query computes them), for the nodes their tokens become: a request's tail is
    asked of the store, then computed and inserted, and its node's backup to the store
    needs the same hashes (the same tokens after the same page). Looked up by the hash of
    the page before and the first page's tokens; at most ``limit`` tails and
    ``limit_bytes`` of tails and hashes (a 32k-token tail and its hashes take 320 KiB),
    the oldest dropped first. Scheduler thread only (a tail's hashes are read once set)."""

    def __init__(self, page_size: int, limit: int = 256, limit_bytes: int = 8 << 20) -> None:
        self._page_bytes = page_size * TOKEN_BYTES
        self._limit = limit
        self._limit_bytes = limit_bytes
        self._bytes = 0
        self._tails: OrderedDict[bytes, HashedTail] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tails)

    @property
    def num_bytes(self) -> int:
        """Bytes of the tails and their hashes kept (or to come)."""
        return self._bytes

    def add(self, entry: HashedTail) -> None:
        """Keep ``entry`` (its hashes may come later)."""
        size = self._size(entry)
        if len(entry.tail) < self._page_bytes or size > self._limit_bytes:
            return
        where = entry.parent + entry.tail[:self._page_bytes]
        old = self._tails.pop(where, None)
        if old is not None:
            self._bytes -= self._size(old)
        self._tails[where] = entry
        self._bytes += size
        while len(self._tails) > self._limit or self._bytes > self._limit_bytes:
            _, gone = self._tails.popitem(last=False)
            self._bytes -= self._size(gone)

    def find(self, parent: bytes, key: bytes) -> bytes | None:
        """The hashes of ``key``'s pages (whole pages) after the page ``parent``, if a tail
        kept here starts with ``key`` and its hashes are computed; else ``None``."""
        found = self._tails.get(parent + key[:self._page_bytes])
        if found is None:
            return None
        joined = found.joined  # read once: set by another thread, once
        if joined is None or not found.tail.startswith(key):
            return None
        return joined[:len(key) // self._page_bytes * PAGE_HASH_BYTES]

    def _size(self, entry: HashedTail) -> int:
        """The tail's bytes and its whole pages' hashes' (known or to come)."""
        return len(entry.tail) + len(entry.tail) // self._page_bytes * PAGE_HASH_BYTES


def node_page_hashes(tree: RadixTree, node: TreeNode, recent: RecentHashes | None = None
                     ) -> bytes:
    """``node``'s page hashes, computing those of it and of its ancestors that lack them
    (taking them from ``recent`` where it has them)."""
    missing = []
    current = node
    while current is not tree.root and current.page_hashes is None:
        missing.append(current)
        assert current.parent is not None, f"{current!r} is not in the tree"
        current = current.parent
    parent = ROOT_HASH if current is tree.root else last_hash_of(current)
    for each in reversed(missing):
        known = None if recent is None else recent.find(parent, each.key)
        each.page_hashes = known if known is not None else \
            key_page_hashes(each.key, tree.page_size, parent)
        parent = each.page_hashes[-PAGE_HASH_BYTES:]
    assert node.page_hashes is not None
    return node.page_hashes


def last_hash(tree: RadixTree, node: TreeNode, recent: RecentHashes | None = None) -> bytes:
    """The hash of ``node``'s last page (:data:`ROOT_HASH` for the root): the parent of the
    chain of whatever follows it."""
    if node is tree.root:
        return ROOT_HASH
    return node_page_hashes(tree, node, recent)[-PAGE_HASH_BYTES:]


def last_hash_of(node: TreeNode) -> bytes:
    assert node.page_hashes is not None
    return node.page_hashes[-PAGE_HASH_BYTES:]


def split_hashes(joined: bytes) -> list[bytes]:
    """Joined page hashes as one 32-byte hash per page."""
    return [joined[i:i + PAGE_HASH_BYTES] for i in range(0, len(joined), PAGE_HASH_BYTES)]
