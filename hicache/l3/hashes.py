"""Page hashes of tree nodes: the chain of :func:`hicache.storage.chain_page_hashes` along
the tree's keys, computed once per node and kept on it (``TreeNode.page_hashes``, 32 bytes
per page; a split cuts them at its page).

A node's hashes need its parent's last hash, so a node without them gets them after its
ancestors that lack them, root side first. Scheduler thread only (nodes are the tree's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def node_page_hashes(tree: RadixTree, node: TreeNode) -> bytes:
    """``node``'s page hashes, computing those of it and of its ancestors that lack them."""
    missing = []
    current = node
    while current is not tree.root and current.page_hashes is None:
        missing.append(current)
        assert current.parent is not None, f"{current!r} is not in the tree"
        current = current.parent
    parent = ROOT_HASH if current is tree.root else last_hash_of(current)
    for each in reversed(missing):
        each.page_hashes = key_page_hashes(each.key, tree.page_size, parent)
        parent = each.page_hashes[-PAGE_HASH_BYTES:]
    assert node.page_hashes is not None
    return node.page_hashes


def last_hash(tree: RadixTree, node: TreeNode) -> bytes:
    """The hash of ``node``'s last page (:data:`ROOT_HASH` for the root): the parent of the
    chain of whatever follows it."""
    if node is tree.root:
        return ROOT_HASH
    return node_page_hashes(tree, node)[-PAGE_HASH_BYTES:]


def last_hash_of(node: TreeNode) -> bytes:
    assert node.page_hashes is not None
    return node.page_hashes[-PAGE_HASH_BYTES:]


def split_hashes(joined: bytes) -> list[bytes]:
    """Joined page hashes as one 32-byte hash per page."""
    return [joined[i:i + PAGE_HASH_BYTES] for i in range(0, len(joined), PAGE_HASH_BYTES)]
