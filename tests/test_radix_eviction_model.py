"""Eviction from the candidate heaps picks exactly what a full scan of the tree would.

Two trees over identical pools take the same random operations (insert, match, lock and
unlock, evict, evict_host, load_back, acks). One is the tree under test; the other, defined
here, evicts the way the tree did before it kept candidate heaps: a heap built from a scan
of every node, with the same predicates and keys computed when the call starts, parents that
become evictable joining during the call. After every step both trees must hold the same
nodes with the same slots, locks, keys and counters, have evicted the same nodes in the
same order, and leave every allocator in the same state. A coarse clock (three calls per
tick) makes ties in the eviction key common, so the node-id tie-break is exercised too.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule
from radix_helpers import HybridRig, Rig, ids

from hicache.config import EvictionPolicy, WritePolicy
from hicache.radix import HiRadixCache, TreeNode, backups
from hicache.radix.tree import slots_of, subtree

TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=10)
SETTINGS = settings(
    max_examples=40, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class ScanTree(HiRadixCache):
    """The model: eviction by a scan of every node into a heap (the old algorithm)."""

    order: list[tuple[str, int]]

    def evict(self, num_tokens: int) -> int:
        heap = [self._scan_entry(n) for n in self.nodes() if self._scan_can_evict_device(n)]
        heapq.heapify(heap)
        freed = scheduled = 0
        while heap and freed + scheduled < num_tokens:
            node = heapq.heappop(heap)[-1]
            if not self._scan_can_evict_device(node):
                continue
            self.order.append(("device", node.node_id))
            parent = node.parent
            if node.is_backed_up:
                self.io.free_device(slots_of(node, "device"))
                node.device = node.device_swa = None
                freed += node.num_tokens
            elif self.write_policy is not WritePolicy.WRITE_BACK:
                freed += self._scan_drop(node, "no_backup")
            elif backups.allocate_one(self, node, evict_after=True):
                scheduled += node.num_tokens
                continue
            else:
                freed += self._scan_drop(node, "host_full")
            if parent is not None and self._scan_can_evict_device(parent):
                heapq.heappush(heap, self._scan_entry(parent))
        if scheduled:
            self.controller.start_writing()
        self.stats.evicted_device_tokens += freed
        return freed

    def evict_host(self, num_tokens: int) -> int:
        heap = [self._scan_entry(n) for n in self.nodes() if self._scan_can_evict_host(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            node = heapq.heappop(heap)[-1]
            if not self._scan_can_evict_host(node):
                continue
            self.order.append(("host", node.node_id))
            parent = node.parent
            self.io.free_host(slots_of(node, "host"), node.host_swa)
            self._detach(node)
            freed += node.num_tokens
            if parent is not None and self._scan_can_evict_host(parent):
                heapq.heappush(heap, self._scan_entry(parent))
        self.stats.evicted_host_tokens += freed
        return freed

    def _scan_entry(self, node: TreeNode) -> tuple[tuple[float, ...], int, TreeNode]:
        if self.eviction_policy is EvictionPolicy.LFU:
            return (float(node.hit_count), node.last_access), node.node_id, node
        return (node.last_access,), node.node_id, node

    def _scan_can_evict_device(self, node: TreeNode) -> bool:
        return (node is not self.root and node.on_device and node.lock_count == 0
                and not node.is_in_flight and not node.evict_on_ack
                and not node.has_device_child())

    def _scan_can_evict_host(self, node: TreeNode) -> bool:
        if node is self.root or not node.is_host_only or node.children or node.lock_count:
            return False
        if node.is_in_flight or self.controller.is_in_flight(slots_of(node, "host")):
            return False
        return node.host_swa is None or not self.controller.is_in_flight(node.host_swa)

    def _scan_drop(self, node: TreeNode, reason: str) -> int:
        below = [n for n in subtree(node) if n is not node]
        for orphan in below:
            self.io.free_host(slots_of(orphan, "host"), orphan.host_swa)
        self.io.free_device(slots_of(node, "device"))
        self._detach(node)
        self.stats.dropped_tokens[reason] += node.num_tokens
        if below:
            self.stats.dropped_tokens["orphaned"] += sum(n.num_tokens for n in below)
        return node.num_tokens


def coarse_clock() -> Callable[[], float]:
    """A clock that ticks every third call, so keys tie often."""
    calls = itertools.count(3)
    return lambda: float(next(calls) // 3)


def record_pops(tree: HiRadixCache, order: list[tuple[str, int]]) -> None:
    """Log every node the tree under test takes from its candidate heaps (each one taken is
    evicted, dropped or written back for eviction)."""
    for tier, heap in (("device", tree._device_candidates), ("host", tree._host_candidates)):
        pop = heap.pop

        def logged(pop: Callable[[], TreeNode | None] = pop, tier: str = tier) -> TreeNode | None:
            node = pop()
            if node is not None:
                order.append((tier, node.node_id))
            return node

        heap.pop = logged  # type: ignore[method-assign]


def snapshot(rig: Rig | HybridRig) -> dict[str, object]:
    """Everything eviction may change: every node's place, slots, locks, key and flags, the
    counters, and each allocator's free runs."""
    tree = rig.tree
    nodes = sorted(
        (n.node_id, n.tokens, n.parent.node_id if n.parent else None,
         *(ids(getattr(n, name)) if getattr(n, name) is not None else None
           for name in ("device", "host", "device_swa", "host_swa")),
         n.lock_count, n.hit_count, n.last_access, n.write_op is None, n.load_op is None,
         n.evict_on_ack)
        for n in tree.nodes()
    )
    runs = {space.name: [a.tolist() for a in allocator.free_runs()]
            for space, allocator in tree.io.allocators().items()}
    return {"nodes": nodes, "stats": tree.stats, "runs": runs}


class EvictionModel(RuleBasedStateMachine):
    """The tree under test and the scan model in lockstep (subclasses pick the policies)."""

    sequences = Bundle("sequences")

    write_policy = WritePolicy.WRITE_THROUGH
    eviction_policy = EvictionPolicy.LRU
    hybrid = False

    def __init__(self) -> None:
        super().__init__()
        self.new = self.make_rig(HiRadixCache)
        self.ref = self.make_rig(ScanTree)
        self.new_order: list[tuple[str, int]] = []
        assert isinstance(self.ref.tree, ScanTree)
        self.ref.tree.order = []
        record_pops(self.new.tree, self.new_order)
        self.locked: list[tuple[TreeNode, TreeNode]] = []

    def make_rig(self, cls: type[HiRadixCache]) -> Rig | HybridRig:
        rig: Rig | HybridRig
        if self.hybrid:
            rig = HybridRig(write_policy=self.write_policy, full_pages=10, swa_pages=6,
                            host_pages=14)
        else:
            rig = Rig(write_policy=self.write_policy, device_pages=10, host_pages=14)
        rig.tree = cls(
            rig.controller, write_policy=self.write_policy, write_through_hits=2,
            eviction_policy=self.eviction_policy, load_back_threshold_tokens=0,
            window_tokens=HybridRig.WINDOW if self.hybrid else None, clock=coarse_clock(),
        )
        return rig

    def rigs(self) -> tuple[Rig | HybridRig, Rig | HybridRig]:
        return self.new, self.ref

    @rule(target=sequences, tokens=TOKENS)
    def insert(self, tokens: list[int]) -> list[int]:
        need = -(-len(tokens) // self.new.page_size) * self.new.page_size
        cached = []
        for rig in self.rigs():
            slots = rig.try_alloc(need)
            if slots is None:
                rig.tree.evict(need)
                rig.ack()
                slots = rig.try_alloc(need)
            cached.append(None if slots is None else rig.insert_slots(tokens, slots)[0])
        assert cached[0] == cached[1]
        return tokens

    @rule(tokens=st.one_of(sequences, TOKENS), lock=st.booleans())
    def match(self, tokens: list[int], lock: bool) -> None:
        new, ref = (rig.tree.match_prefix(tokens) for rig in self.rigs())
        assert ids(new.device_indices) == ids(ref.device_indices)
        assert new.host_hit_tokens == ref.host_hit_tokens
        if lock and new.device_hit_tokens:
            self.new.tree.lock(new.last_device_node)
            self.ref.tree.lock(ref.last_device_node)
            self.locked.append((new.last_device_node, ref.last_device_node))

    @precondition(lambda self: bool(self.locked))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        new, ref = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1)))
        self.new.tree.unlock(new)
        self.ref.tree.unlock(ref)

    @rule(num_tokens=st.integers(0, 24), ack_first=st.booleans())
    def evict(self, num_tokens: int, ack_first: bool) -> None:
        if ack_first:
            self.ack()
        assert self.new.tree.evict(num_tokens) == self.ref.tree.evict(num_tokens)

    @rule(num_tokens=st.integers(0, 16))
    def evict_host(self, num_tokens: int) -> None:
        assert self.new.tree.evict_host(num_tokens) == self.ref.tree.evict_host(num_tokens)

    @rule(tokens=sequences, quota=st.integers(0, 24), start=st.booleans())
    def load_back(self, tokens: list[int], quota: int, start: bool) -> None:
        loaded = []
        for rig in self.rigs():
            result = rig.tree.match_prefix(tokens)
            got = rig.tree.load_back(result.last_host_node, quota)
            loaded.append((got.refused, ids(got.device_indices)))
            if start:
                rig.tree.start_loading()
        assert loaded[0] == loaded[1]

    @rule()
    def ack(self) -> None:
        assert self.new.ack() == self.ref.ack()

    @rule()
    def start_ops(self) -> None:
        """Issue queued loads and writes without acknowledging them (slots stay in flight)."""
        for rig in self.rigs():
            rig.tree.start_loading()
            rig.controller.start_writing()

    @invariant()
    def same_as_the_scan(self) -> None:
        assert self.new_order == self.ref.tree.order, "evicted other nodes or in another order"
        assert snapshot(self.new) == snapshot(self.ref)
        assert self.new.tree.num_nodes == len(list(self.new.tree.nodes()))
        self.new.tree.check_integrity()

    def teardown(self) -> None:
        for new, ref in self.locked:
            self.new.tree.unlock(new)
            self.ref.tree.unlock(ref)
        for rig in self.rigs():
            rig.tree.apply_acks(rig.controller.drain())
        for _ in range(3):
            self.evict(10**6, ack_first=True)
            self.same_as_the_scan()
        self.ack()
        self.evict_host(10**6)
        self.same_as_the_scan()
        assert not list(self.new.tree.nodes())


class WriteThroughSelectiveLFU(EvictionModel):
    write_policy = WritePolicy.WRITE_THROUGH_SELECTIVE
    eviction_policy = EvictionPolicy.LFU


class WriteBack(EvictionModel):
    write_policy = WritePolicy.WRITE_BACK


class WriteBackLFU(EvictionModel):
    write_policy = WritePolicy.WRITE_BACK
    eviction_policy = EvictionPolicy.LFU


class HybridWriteThrough(EvictionModel):
    hybrid = True


class HybridWriteBack(EvictionModel):
    hybrid = True
    write_policy = WritePolicy.WRITE_BACK


def test_eviction_never_walks_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicting one page of a tree of 60 leaves checks a handful of nodes, never all."""
    rig = Rig(device_pages=200, host_pages=200)
    for first in range(60):
        rig.put([first, 0, 1, 1])
    rig.ack()
    rig.tree.evict(0)  # takes in the nodes inserted so far
    checked: list[TreeNode] = []
    can_evict = rig.tree._can_evict_device

    def counted(node: TreeNode) -> bool:
        checked.append(node)
        return can_evict(node)

    monkeypatch.setattr(rig.tree._device_candidates, "_is_candidate", counted)
    monkeypatch.setattr(rig.tree, "nodes", lambda: pytest.fail("eviction walked the tree"))
    assert rig.tree.evict(2) == 4 and rig.tree.evict_host(2) == 4
    assert [n.tokens for n in checked] == [(0, 0, 1, 1), ()]  # the oldest leaf, its parent
    monkeypatch.undo()
    rig.tree.check_integrity()


def test_stale_entries_stay_bounded() -> None:
    """Repeated unlocks of one leaf leave at most three heap entries per node."""
    rig = Rig()
    rig.put([1, 1, 2, 2])
    rig.ack()
    leaf = rig.tree.match_prefix([1, 1, 2, 2]).last_device_node
    for _ in range(500):
        rig.tree.lock(leaf)
        rig.tree.unlock(leaf)
        rig.tree.evict(0)
    assert len(rig.tree._device_candidates) <= 3 * rig.tree.num_nodes + 64
    assert rig.tree.evict(4) == 4


TestWriteThroughLRU = EvictionModel.TestCase
TestWriteThroughSelectiveLFU = WriteThroughSelectiveLFU.TestCase
TestWriteBackLRU = WriteBack.TestCase
TestWriteBackLFU = WriteBackLFU.TestCase
TestHybridWriteThrough = HybridWriteThrough.TestCase
TestHybridWriteBack = HybridWriteBack.TestCase
for case in (TestWriteThroughLRU, TestWriteThroughSelectiveLFU, TestWriteBackLRU,
             TestWriteBackLFU, TestHybridWriteThrough, TestHybridWriteBack):
    case.settings = SETTINGS
del case
