"""Audit of the service under interrupted calls and its background thread's timing.

- An exception out of the write-back that an eviction starts (an observer's, a Ctrl-C) left
  the node it had taken off the eviction heap there for good: an unlocked device leaf with
  nothing in flight that no later ``evict`` or ``alloc_device`` freed.
- The background thread took finished ops from the controller under the service lock but
  queued their acks after releasing it: a scheduler call in between found them nowhere,
  and ``insert`` or ``free_device`` of pages whose window backup had just finished tripped
  an assertion half way, leaving pages owned by the tree and held by the engine.
- A state machine of random scheduler calls with one-shot observer exceptions checks the
  tree's integrity after every call and that everything drains at the end.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from test_service import PAGE, make_config, put

from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices


class Boom(Exception):
    """An observer's error."""


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_a_write_back_eviction_that_raises_leaves_its_node_evictable(
        exc: type[BaseException]) -> None:
    service = build_service(make_config("write_back"))  # 32 device tokens, pages of 2
    try:
        for tokens in ([1, 2, 3, 4], [5, 6, 7, 8]):
            assert put(service, tokens)
        first = next(n for n in service.tree.nodes() if n.tokens == (1, 2, 3, 4))

        def observer(*_: object) -> None:
            raise exc("observer")

        service.controller.add_observer(observer)
        with pytest.raises(exc):
            service.evict(2)  # writes [1, 2, 3, 4] back first: the observer raises
        service.controller.remove_observer(observer)
        service.check_integrity()
        assert first.on_device and first.lock_count == 0 and first.write_op is None
        for _ in range(3):
            service.evict(10**6)
            service.step()
        assert not first.on_device, "an unlocked device leaf was never evicted again"
        assert service.alloc_device(32) is not None
    finally:
        service.stop()


def test_alloc_device_after_an_eviction_that_raised_empties_the_pool() -> None:
    service = build_service(make_config("write_back"))
    try:
        for i in range(16):  # one page a node until the 32-token pool is full
            if not put(service, [100 + i, 100 + i]):
                break
        service.step()
        armed = [True]

        def observer(*_: object) -> None:
            if armed:
                armed.clear()
                raise Boom("observer")

        service.controller.add_observer(observer)
        with pytest.raises(Boom):
            service.alloc_device(32)
        service.controller.remove_observer(observer)
        service.check_integrity()
        for _ in range(3):
            if service.alloc_device(32) is not None:
                return
            service.step()
        leaves = [n.tokens for n in service.tree.nodes() if n.on_device and not n.lock_count]
        pytest.fail(f"alloc_device(32) never succeeds; unlocked device leaves: {leaves}")
    finally:
        service.stop()


class PreemptedQueue(collections.deque):  # type: ignore[type-arg]
    """The background thread's ack queue, whose thread loses the CPU as it queues an ack
    (a GIL switch or a preemption there does the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.polled = threading.Event()

    def append(self, ack: object) -> None:
        self.polled.set()
        time.sleep(0.3)
        super().append(ack)


@pytest.mark.parametrize("call", ["insert", "free_device"])
def test_a_call_right_after_the_thread_polled_a_window_backup_sees_its_ack(call: str) -> None:
    service = build_service(make_config(hybrid=True, interval_s=3600.0))
    acks = service._poller._acks = PreemptedQueue()
    service.start()
    try:
        slots = service.alloc_device(8)
        assert slots is not None
        service.release_window(Indices(slots.tensor[:4], IndexSpace.DEVICE_FULL))
        assert acks.polled.wait(10), "the background thread never polled the window backup"
        if call == "insert":  # the thread holds the ack now: the call waits for it
            service.insert(list(range(1, 9)), slots)
        else:
            service.free_device(slots)
        service.step()
        service.check_integrity()
    finally:
        service.stop()


TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=10)


class InterruptedCalls(RuleBasedStateMachine):
    """Random scheduler calls on a service over CPU pools; ``arm`` makes the next transfer
    call's observer raise once. Integrity after every call; all freed at the end."""

    policy = "write_through"
    hybrid = False

    def __init__(self) -> None:
        super().__init__()
        self.service = build_service(make_config(self.policy, hybrid=self.hybrid,
                                                 interval_s=3600))
        self.held: list[Indices] = []
        self.locked: list[Any] = []
        self.armed = False
        self.service.controller.add_observer(self._observer)

    def _observer(self, *_: object) -> None:
        if self.armed:
            self.armed = False
            raise Boom("observer")

    def call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Boom:
            return None

    @rule()
    def arm(self) -> None:
        self.armed = True

    @rule(n=st.integers(0, 12))
    def alloc(self, n: int) -> None:
        got = self.call(self.service.alloc_device, n)
        if got is not None and len(got):
            self.held.append(got)

    @rule(tokens=TOKENS, data=st.data())
    def serve(self, tokens: list[int], data: st.DataObject) -> None:
        """Match, lock, allocate the rest, insert, free the partial tail, release."""
        service = self.service
        match = self.call(service.match, tokens)
        if match is None:
            return
        service.lock(match.last_device_node)
        try:
            own = self.call(service.alloc_device, len(tokens) - match.device_hit_tokens)
            if own is None:
                return
            slots = Indices(torch.cat([match.device_indices.tensor, own.tensor]),
                            IndexSpace.DEVICE_FULL)
            if self.hybrid and len(own) > PAGE and data.draw(st.booleans()):
                self.call(service.release_window,
                          Indices(own.tensor[:PAGE], IndexSpace.DEVICE_FULL))
            if self.call(service.insert, tokens, slots) is None:
                self.held.append(own)  # the insert raised: still the engine's
                return
            tail = Indices(slots.tensor[len(tokens) // PAGE * PAGE:], IndexSpace.DEVICE_FULL)
            if len(tail):
                service.free_device(tail)
        finally:
            service.release(match.last_device_node)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if self.held:
            self.service.free_device(self.held.pop(data.draw(st.integers(0, len(self.held) - 1))))

    @rule(tokens=TOKENS)
    def lock(self, tokens: list[int]) -> None:
        node = self.service.match(tokens).last_host_node
        self.service.lock(node)
        self.locked.append(node)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.locked:
            self.service.release(self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1))))

    @rule(tokens=TOKENS, quota=st.integers(0, 16))
    def load_back(self, tokens: list[int], quota: int) -> None:
        match = self.call(self.service.match, tokens)
        if match is None or not match.host_hit_tokens:
            return
        self.service.lock(match.last_host_node)
        try:
            self.call(self.service.load_back, match, quota)
            self.call(self.service.start_loading)
        finally:
            self.service.release(match.last_host_node)

    @rule()
    def step(self) -> None:
        self.call(self.service.step)

    @rule(n=st.integers(0, 20))
    def evict(self, n: int) -> None:
        self.call(self.service.evict, n)

    @rule(n=st.integers(0, 20))
    def evict_host(self, n: int) -> None:
        self.call(self.service.evict_host, n)

    @rule(n=st.integers(0, 20))
    def evict_swa(self, n: int) -> None:
        if self.hybrid:
            self.call(self.service.evict_swa, n)

    @invariant()
    def integrity(self) -> None:
        self.service.check_integrity()

    def teardown(self) -> None:
        service = self.service
        try:
            self.armed = False
            for node in self.locked:
                service.release(node)
            for got in self.held:
                service.free_device(got)
            for _ in range(6):
                service.step()
                service.evict(10**6)
                service.step()
                service.evict_host(10**6)
            service.check_integrity()
            left = [(n.tokens, n.on_device, n.host is not None, n.lock_count) for n in
                    service.tree.nodes()]
            assert not left, f"nodes left after everything was released and evicted: {left}"
            for space, allocator in service.tree.io.allocators().items():
                assert allocator.num_free_tokens == allocator.capacity_tokens, f"{space} leaked"
        finally:
            service.stop()


def _machine(policy: str, hybrid: bool) -> Any:
    machine = type(f"InterruptedCalls_{policy}_{hybrid}", (InterruptedCalls,),
                   {"policy": policy, "hybrid": hybrid})
    case = machine.TestCase
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                             suppress_health_check=list(HealthCheck))
    return case


TestWriteThrough = _machine("write_through", False)
TestWriteBack = _machine("write_back", False)
TestSelective = _machine("write_through_selective", False)
TestHybridWriteThrough = _machine("write_through", True)
TestHybridWriteBack = _machine("write_back", True)
