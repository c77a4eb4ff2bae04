"""Random insert / match / evict / evict_host / load_back / ack / lock sequences against a
model of what the tree may and must hold.

The model:

- ``inserted``: every page-aligned sequence ever inserted. A match never covers more than
  the longest page-aligned common prefix with one of them (the tree invents nothing).
- Right after an insert the whole page-aligned sequence is on the device.
- ``locked``: prefixes the test locked, with the device slots they had. While locked they
  stay on the device at exactly those slots, whatever else happens.
- Every device-matched row and every loaded-back row holds the value the engine wrote for
  that prefix (rows are a hash of the prefix; see ``radix_helpers``).
- Evictions free exactly what they report; ``check_integrity()`` holds after every step.
- Teardown: drain, unlock, evict everything; every allocator is back to full capacity.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule
from radix_helpers import HybridRig, Rig, ids

from hicache.config import EvictionPolicy, WritePolicy
from hicache.radix import TreeNode

TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=10)
SETTINGS = settings(
    max_examples=50, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class RadixMachine(RuleBasedStateMachine):
    """The plain tree under one write policy (subclasses pick the policy and the rig)."""

    sequences = Bundle("sequences")  # inserted token lists: later rules revisit them

    write_policy = WritePolicy.WRITE_THROUGH
    eviction_policy = EvictionPolicy.LRU

    def __init__(self) -> None:
        super().__init__()
        self.rig: Rig | HybridRig = self.make_rig()
        self.tree = self.rig.tree
        self.inserted: set[tuple[int, ...]] = set()
        self.locked: list[tuple[TreeNode, tuple[int, ...], list[int]]] = []

    def make_rig(self) -> Rig | HybridRig:
        return Rig(write_policy=self.write_policy, eviction_policy=self.eviction_policy,
                   device_pages=10, host_pages=14, hits=2)

    def bound(self, tokens: list[int]) -> int:
        """Longest page-aligned prefix of ``tokens`` that some inserted sequence shares."""
        key = self.tree.page_key(tokens)
        best = 0
        for seq in self.inserted:
            n = 0
            while n < min(len(key), len(seq)) and key[n] == seq[n]:
                n += 1
            best = max(best, n - n % self.tree.page_size)
        return best

    @rule(target=sequences, tokens=TOKENS)
    def insert(self, tokens: list[int]) -> list[int]:
        need = -(-len(tokens) // self.rig.page_size) * self.rig.page_size
        slots = self.rig.try_alloc(need)
        if slots is None:
            self.tree.evict(need)
            self.rig.ack()
            slots = self.rig.try_alloc(need)
        if slots is None:
            return tokens
        cached, _ = self.rig.insert_slots(tokens, slots)
        key = self.tree.page_key(tokens)
        assert cached <= len(key)
        self.inserted.add(key)
        prefix = self.tree.device_prefix(tokens)
        assert len(prefix) == len(key), "a just-inserted sequence is not all on the device"
        assert self.rig.device_rows_ok(tokens, prefix)
        return tokens

    @rule(tokens=st.one_of(sequences, TOKENS))
    def match(self, tokens: list[int]) -> None:
        result = self.tree.match_prefix(tokens)
        assert result.device_hit_tokens + result.host_hit_tokens <= self.bound(tokens)
        assert self.rig.device_rows_ok(tokens, result.device_indices)

    @rule(num_tokens=st.integers(0, 24), ack_first=st.booleans())
    def evict(self, num_tokens: int, ack_first: bool) -> None:
        if ack_first:  # as a scheduler step would
            self.rig.ack()
        before = self.rig.allocator.num_free_tokens
        freed = self.tree.evict(num_tokens)
        assert self.rig.allocator.num_free_tokens - before == freed

    @rule(num_tokens=st.integers(0, 12))
    def evict_host(self, num_tokens: int) -> None:
        host = self.rig.controller.host_pool.allocator
        before = host.num_free_tokens
        freed = self.tree.evict_host(num_tokens)
        assert host.num_free_tokens - before == freed

    @rule(tokens=sequences, quota=st.integers(0, 24))
    def load_back(self, tokens: list[int], quota: int) -> None:
        result = self.tree.match_prefix(tokens)
        if not result.host_hit_tokens:
            return
        got = self.tree.load_back(result.last_host_node, quota)
        if not got.queued:
            return
        loaded = got.device_indices
        assert len(loaded) == result.host_hit_tokens <= quota
        self.tree.start_loading()  # on a CPU the rows are in place once issued
        prefix = self.tree.device_prefix(tokens)
        assert ids(prefix) == ids(result.device_indices) + ids(loaded)
        assert self.rig.device_rows_ok(tokens, prefix)

    @rule()
    def apply_acks(self) -> None:
        self.rig.ack()

    @rule(tokens=sequences)
    def lock(self, tokens: list[int]) -> None:
        result = self.tree.match_prefix(tokens)
        if result.device_hit_tokens:
            self.tree.lock(result.last_device_node)
            key = self.tree.page_key(tokens)[:result.device_hit_tokens]
            self.locked.append((result.last_device_node, key, ids(result.device_indices)))

    @precondition(lambda self: bool(self.locked))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.locked) - 1))
        node, _, _ = self.locked.pop(index)
        self.tree.unlock(node)

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        for _, key, slots in self.locked:
            assert ids(self.tree.device_prefix(key)) == slots, "a locked prefix moved"

    def teardown(self) -> None:
        for node, _, _ in self.locked:
            self.tree.unlock(node)
        self.tree.issue_queued_backups()  # what a stepped tree still holds queued
        self.tree.apply_acks(self.rig.controller.drain())
        for _ in range(4):
            self.tree.evict(10**6)
            self.rig.ack()
        self.tree.evict_host(10**6)
        self.tree.check_integrity()
        assert not list(self.tree.nodes())
        for space, allocator in self.tree.io.allocators().items():
            assert allocator.num_free_tokens == allocator.capacity_tokens, f"{space} leaked"


class WriteThroughSelectiveLFU(RadixMachine):
    write_policy = WritePolicy.WRITE_THROUGH_SELECTIVE
    eviction_policy = EvictionPolicy.LFU


class WriteBack(RadixMachine):
    write_policy = WritePolicy.WRITE_BACK


class SteppedWriteThrough(RadixMachine):
    """As a service drives the tree: the backups insert and match queue wait (their nodes
    locked, no host slots) until a step issues all of them as one write."""

    def make_rig(self) -> Rig | HybridRig:
        rig = super().make_rig()
        rig.tree.issue_backups = False
        return rig

    @rule()
    def step(self) -> None:
        self.tree.issue_queued_backups()


class SteppedWriteThroughSelective(SteppedWriteThrough):
    write_policy = WritePolicy.WRITE_THROUGH_SELECTIVE


class HybridWriteThrough(RadixMachine):
    def make_rig(self) -> Rig | HybridRig:
        return HybridRig(full_pages=10, swa_pages=6, host_pages=14)


class SteppedHybridWriteThrough(SteppedWriteThrough):
    """A hybrid tree driven as a service drives it: a step writes the full and SWA rows of
    all its queued backups in one op, with the SWA host room it makes."""

    def make_rig(self) -> Rig | HybridRig:
        rig = HybridRig(full_pages=10, swa_pages=6, host_pages=14)
        rig.tree.issue_backups = False
        return rig


TestWriteThrough = RadixMachine.TestCase
TestWriteThroughSelectiveLFU = WriteThroughSelectiveLFU.TestCase
TestWriteBack = WriteBack.TestCase
TestHybridWriteThrough = HybridWriteThrough.TestCase
TestSteppedWriteThrough = SteppedWriteThrough.TestCase
TestSteppedWriteThroughSelective = SteppedWriteThroughSelective.TestCase
TestSteppedHybridWriteThrough = SteppedHybridWriteThrough.TestCase
for case in (TestWriteThrough, TestWriteThroughSelectiveLFU, TestWriteBack,
             TestHybridWriteThrough, TestSteppedWriteThrough, TestSteppedWriteThroughSelective,
             TestSteppedHybridWriteThrough):
    case.settings = SETTINGS
del case
