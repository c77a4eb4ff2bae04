"""Pages that arrive on the host from elsewhere (the shared store) join the tree.

:func:`attach_host_run` hangs a run of whole pages, whose rows are already in host slots,
below a node as host-only nodes: each is backed up (its host copy is complete), so a later
match finds it as a host hit and ``load_back`` brings it to the device like any other. Pages
the tree holds already (another request cached them meanwhile) keep the tree's copy; their
arrived slots are handed back for the caller to free.

Scheduler thread only, like the rest of the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.pools import IndexSpace, Indices
from hicache.storage.keys import PAGE_HASH_BYTES

from .key import TOKEN_BYTES
from .node import TreeNode, cat_indices, slice_indices

if TYPE_CHECKING:
    from .tiers import TieredRadixTree


def attach_host_run(
    tree: TieredRadixTree, node: TreeNode, key: bytes, page_hashes: bytes, host: Indices,
    host_swa: Indices | None = None,
) -> tuple[int, Indices, Indices | None]:
    """Attach the pages of ``key`` below ``node`` as host-only nodes.

    Args:
        tree: the tree; ``node`` must be live in it (lock it while the pages arrive).
        node: the node the run continues (the root for a run from the first page).
        key: whole pages of token ids as tree key bytes, following ``node``'s key.
        page_hashes: the chained hash of each page of ``key``, joined (32 bytes each).
        host: ``HOST_FULL`` slots holding the pages' rows, aligned with ``key``.
        host_swa: for a hybrid model, ``HOST_SWA`` slots holding their SWA rows, aligned.
    Returns:
        tokens attached, and the slots (full, SWA) of pages the tree had already, for the
        caller to free.
    """
    assert (host_swa is not None) == tree.io.is_hybrid, "SWA slots iff the model is hybrid"
    assert len(host) * TOKEN_BYTES == len(key), "one host slot per token of the key"
    assert len(page_hashes) * tree.page_size * TOKEN_BYTES == len(key) * PAGE_HASH_BYTES, \
        "one page hash per page of the key"
    if node is not tree.root:
        tree._check_node(node, "attach_host_run")
    step, page = tree._page_bytes, tree.page_size
    now, at, attached = tree._clock(), 0, 0
    unused: list[Indices] = []
    unused_swa: list[Indices] = []
    while at < len(key):
        pos = at // TOKEN_BYTES
        child = node.children.get(key[at:at + step])
        if child is None:
            child = tree._new_child(node, key[at:], None)
            child.host = slice_indices(host, pos, len(host))
            if host_swa is not None:
                child.host_swa = slice_indices(host_swa, pos, len(host))
            child.page_hashes = page_hashes[pos // page * PAGE_HASH_BYTES:]
            child.in_storage = True
            child.last_access = now
            attached = child.num_tokens
            break
        common = tree._common_bytes(child.key, key, at) // TOKEN_BYTES
        if common < child.num_tokens:
            child = tree._split(child, common)
        unused.append(slice_indices(host, pos, pos + common))
        if host_swa is not None:
            unused_swa.append(slice_indices(host_swa, pos, pos + common))
        node, at = child, at + common * TOKEN_BYTES
    swa = None if host_swa is None else cat_indices(unused_swa, IndexSpace.HOST_SWA)
    return attached, cat_indices(unused, IndexSpace.HOST_FULL), swa
