"""The background integrity check in slices: it finds what the full check finds, gives up
when the scheduler calls between two slices, and never holds the lock for a whole walk."""

from __future__ import annotations

import threading
import time

import pytest

from hicache import integrity_slices
from hicache.bench.scheduler import ChatWorkload, admit, fill, free_tail, make_service
from hicache.radix.node import slice_indices
from hicache.service import HiCacheService


def filled(tokens: int = 20_000) -> HiCacheService:
    service = make_service(capacity_tokens=2 * tokens + 4096)
    fill(service, ChatWorkload(seed=3, num_systems=20), tokens)
    service.background_check.slice_s = 1e-5  # a few nodes a slice: many slices
    return service


def run_to_end(service: HiCacheService, max_slices: int = 100_000) -> int:
    """Step the check until one completes; returns the slices it took."""
    check = service.background_check
    before = check.stats.slices
    for _ in range(max_slices):
        if check.step():
            return check.stats.slices - before
    raise AssertionError("the sliced check never completed")


def test_sliced_check_completes_in_many_slices_on_a_healthy_tree() -> None:
    service = filled()
    try:
        slices = run_to_end(service)
        assert slices > 10, "the walk was not split into slices"
        stats = service.background_check.stats
        assert stats.completed == 1
        # each hold of the lock timed: what the scheduler benchmark reports as the longest
        assert 0 < stats.last_s <= stats.longest_slice_s < 0.5
        assert 0 < stats.last_start <= time.perf_counter()
        service.check_integrity()  # the full check agrees
    finally:
        service.stop()


def test_sliced_check_finds_a_leaked_page() -> None:
    """A page allocated behind the tree's back (owned by nobody) is a leak, as for the
    full check."""
    service = filled()
    try:
        leaked = service.controller.device_allocator.try_alloc(16)
        assert leaked is not None
        with pytest.raises(RuntimeError, match="owned by no node and not held by the engine"):
            run_to_end(service)
        with pytest.raises(RuntimeError, match="leak"):
            service.check_integrity()
        assert service.background_check.stats.unconfirmed == 0  # confirmed, then raised
    finally:
        service.controller.device_allocator.free(leaked)
        service.stop()


def test_a_slice_never_waits_for_the_lock() -> None:
    """While a scheduler call holds the service lock, a step does nothing and says no
    check completed: no slice, no check begun."""
    service = filled(2_000)
    check = service.background_check
    try:
        held, done = threading.Event(), threading.Event()

        def scheduler_call() -> None:
            with service.service_lock:
                held.set()
                done.wait(10.0)

        caller = threading.Thread(target=scheduler_call)
        caller.start()
        assert held.wait(10.0)
        try:
            assert check.step() is False
            assert check.stats.slices == 0 and not check.in_progress
        finally:
            done.set()
            caller.join()
        assert run_to_end(service) >= 1 and check.stats.completed == 1
    finally:
        service.stop()


def test_a_finding_the_full_check_does_not_confirm_is_dropped_and_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice that finds something the full check (one hold of the lock) does not find
    came from a tree that changed under the walk: no error, counted once as unconfirmed,
    and the next step starts a new check, which completes."""
    service = filled(2_000)
    check = service.background_check
    walk = integrity_slices.TreeCheck.walk
    raised: list[bool] = []

    def walk_once_wrong(self: integrity_slices.TreeCheck, deadline: float) -> bool:
        if not raised:
            raised.append(True)
            raise RuntimeError("a node's slots changed under the walk")
        return walk(self, deadline)

    monkeypatch.setattr(integrity_slices.TreeCheck, "walk", walk_once_wrong)
    try:
        assert check.step() is False  # begins the check
        assert check.step() is False  # the slice's finding, not confirmed
        assert check.stats.unconfirmed == 1 and not check.in_progress
        run_to_end(service)
        assert check.stats.completed == 1 and check.stats.unconfirmed == 1
    finally:
        service.stop()


def test_sliced_check_finds_a_page_owned_twice() -> None:
    """A node given another node's device pages: both the sliced and the full check name
    the page owned twice (the first node's own pages are then leaked, found after)."""
    service = filled()
    try:
        on_device = sorted((n for n in service.tree.nodes() if n.device is not None),
                           key=lambda n: n.num_tokens)
        small, large = on_device[0], on_device[-1]
        saved = small.device
        small.device = slice_indices(large.device, 0, small.num_tokens)
        with pytest.raises(RuntimeError, match="is owned by nodes"):
            run_to_end(service)
        with pytest.raises(RuntimeError, match="is owned by nodes"):
            service.check_integrity()
        small.device = saved
        service.check_integrity()
    finally:
        service.stop()


def test_a_scheduler_call_between_slices_makes_the_check_start_over() -> None:
    service = filled()
    try:
        check = service.background_check
        check.step()  # pool scans
        check.step()  # first nodes
        assert check.in_progress
        service.match(list(range(64)))  # a scheduler call: the tree may have changed
        assert not check.step() and not check.in_progress
        assert check.stats.abandoned == 1 and check.stats.completed == 0
        run_to_end(service)
        assert check.stats.completed == 1
    finally:
        service.stop()


def test_the_thread_issuing_queued_backups_makes_the_check_start_over() -> None:
    """The background thread allocates the host slots of backups no step issued (a change
    to the tree, under the lock): a check it was walking starts over."""
    service = filled()
    try:
        workload = ChatWorkload(seed=5, num_systems=2)
        key, match, slots = admit(service, workload.next_prompt())
        service.insert(key, slots)  # its backup queued, no step after it
        check = service.background_check
        check.step()
        check.step()
        assert check.in_progress and service.tree.has_queued_backups
        service._poller._poll_once()  # the thread's pass: issues the backup, polls
        assert not service.tree.has_queued_backups and not check.in_progress
        assert check.stats.abandoned == 1 and service.stats.integrity_checks_abandoned == 1
        run_to_end(service)
        assert check.stats.completed == 1
        free_tail(service, len(key), slots)
        service.release(match.last_device_node)
        service.step()
        service.check_integrity()
    finally:
        service.stop()


def test_the_background_thread_completes_checks_while_the_scheduler_is_idle() -> None:
    service = make_service(capacity_tokens=40_000, interval_s=0.01)
    fill(service, ChatWorkload(seed=4, num_systems=20), 10_000)
    service.start()
    try:
        deadline = time.monotonic() + 20
        while service.stats.integrity_checks < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.stats.integrity_checks >= 2
        assert service.background_check.stats.slices > service.stats.integrity_checks
    finally:
        service.stop()


def test_sliced_check_verifies_the_allocators_from_their_snapshots() -> None:
    """A free count that disagrees with the free map: found from the copies taken under the
    lock, verified after it."""
    service = filled(4_000)
    allocator = service.controller.device_allocator
    try:
        allocator._num_free_pages += 1
        with pytest.raises(RuntimeError, match="free count"):
            run_to_end(service)
        assert not service.background_check.in_progress
    finally:
        allocator._num_free_pages -= 1
        service.check_integrity()
        service.stop()
