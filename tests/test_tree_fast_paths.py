"""The radix tree's shortcuts for the common case answer as their general form does: a
leaf's detach (no subtree walk), a heap's pop (its liveness test inlined) and the common
prefix of a node's key (no slice copied when the whole node fits)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.radix import RadixTree, TreeNode
from hicache.radix.eviction import CandidateHeap
from hicache.radix.key import TOKEN_BYTES, key_bytes
from hicache.radix.tree import subtree

PAGE = 2


def grow(tree: RadixTree, parent: TreeNode, *tokens: int) -> TreeNode:
    """A new child of ``parent`` keyed by ``tokens`` (whole pages)."""
    return tree._new_child(parent, key_bytes(list(tokens), "test"), None)


def test_detaching_a_leaf_or_a_subtree_marks_and_counts_every_node_it_removes() -> None:
    """A leaf leaves alone; an inner node takes its subtree: each removed node is marked
    detached and counted off, the others are untouched, as ``nodes()`` walks them."""
    tree = RadixTree(PAGE)
    upper = grow(tree, tree.root, 1, 2)
    middle = grow(tree, upper, 3, 4)
    leaves = [grow(tree, middle, 5, 6), grow(tree, middle, 7, 8), grow(tree, upper, 9, 9)]
    assert tree.num_nodes == 5
    tree._detach(leaves[0])
    assert leaves[0].is_detached and tree.num_nodes == len(list(tree.nodes())) == 4
    gone = list(subtree(middle))
    tree._detach(middle)
    assert all(node.is_detached for node in gone) and not leaves[2].is_detached
    assert tree.num_nodes == len(list(tree.nodes())) == 2
    assert {node.node_id for node in tree.nodes()} == {upper.node_id, leaves[2].node_id}


def test_a_pop_skips_exactly_the_entries_the_liveness_test_refuses() -> None:
    """Entries of detached nodes, of nodes whose key moved and of nodes that stopped being
    candidates are dropped; the first live entry in key order is returned each time."""
    tree = RadixTree(PAGE)
    nodes = [grow(tree, tree.root, i, i) for i in range(1, 7)]
    for age, node in enumerate(nodes):
        node.last_access = float(age)
    barred = {nodes[2].node_id}
    heap = CandidateHeap(lambda node: node.last_access,
                         lambda node: node.node_id not in barred)
    heap.offer_all(nodes, tree.num_nodes)
    tree._detach(nodes[0])  # detached
    nodes[1].last_access = 10.0  # its entry is stale; no new one offered
    # what the general test keeps, in key order
    live = [entry[3] for entry in sorted(heap._heap) if heap._is_live(entry)]
    popped = []
    while (node := heap.pop()) is not None:
        popped.append(node)
    assert popped == live == nodes[3:]
    assert len(heap) == 0



@settings(max_examples=300, deadline=None)
@given(node_pages=st.lists(st.integers(0, 2), min_size=1, max_size=6),
       key_pages=st.lists(st.integers(0, 2), min_size=0, max_size=8),
       lead=st.integers(0, 2))
def test_the_common_prefix_is_counted_in_whole_equal_pages(
        node_pages: list[int], key_pages: list[int], lead: int) -> None:
    """``_common_bytes`` (``startswith`` when the whole node fits in the key, a slice
    comparison otherwise, a binary search on a difference) counts the leading pages that
    are equal, as a page-by-page comparison does."""
    tree = RadixTree(PAGE)
    node_key = key_bytes([t for p in node_pages for t in (p, p + 1)], "test")
    key = key_bytes([9, 9] * lead + [t for p in key_pages for t in (p, p + 1)], "test")
    pos, page = lead * PAGE * TOKEN_BYTES, PAGE * TOKEN_BYTES
    equal = 0
    while (equal + 1) * page <= min(len(node_key), len(key) - pos) and \
            node_key[equal * page:(equal + 1) * page] == key[pos + equal * page:
                                                              pos + (equal + 1) * page]:
        equal += 1
    assert tree._common_bytes(node_key, key, pos) == equal * page
