"""Audit of a service's life, continued: a Ctrl-C that lands inside a call or inside
``start``, a background thread that fails, ``stop`` from a thread other than the scheduler's
and while the thread is in the middle of an integrity check, and ``stop`` with the shared
store (L3) busy or unreachable.

A Ctrl-C is raised where it could land with real code paths: by a transfer observer
(``controller.add_observer``, called once the op was queued; its exception un-queues the op
and frees its slots, then reaches the caller) or by a thread whose ``start`` is interrupted.
The background thread fails through an observer that raises on it, as a tracer that lost its
connection would.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from radix_helpers import expected_rows, read_rows
from test_l3_tier import fetch, pool_of, settle
from test_l3_tier import put as put_rows
from test_lifecycle_audit import (
    MODEL,
    A,
    can_bind,
    file_store,
    footprint,
    free_port,
    make_config,
)
from test_service_refusals import put

from hicache import build_service
from hicache.controller import Direction
from hicache.service import HiCacheService, ServiceError

NEW = [7, 7, 8, 8]
Observer = Callable[[Direction, object, object], None]


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``predicate``; the deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def interrupt_once(direction: Direction) -> Observer:
    """An observer that raises KeyboardInterrupt at the first ``direction`` transfer queued
    on the main thread (a Ctrl-C landing right after the controller queued it)."""
    armed = [True]

    def observer(queued: Direction, transfers: object, tag: object) -> None:
        if armed and queued is direction and threading.current_thread() is \
                threading.main_thread():
            armed.clear()
            raise KeyboardInterrupt

    return observer


def queue_backup(service: HiCacheService) -> None:
    """Insert NEW without a step: its backup is queued, not issued."""
    held = service.alloc_device(len(NEW))
    assert held is not None
    service.insert(NEW, held)
    assert service.tree.has_queued_backups


def stop_anyway(service: HiCacheService) -> None:
    """Cleanup after a test that may have found a bug: stop, again while a stop fails (its
    errors are the test's findings, reported by its own assertions)."""
    for _ in range(3):
        with contextlib.suppress(Exception):
            service.stop()


class InterruptedStart(threading.Thread):
    """A thread whose ``start`` is interrupted by a Ctrl-C when its name is ``target``."""

    target = ""

    def start(self) -> None:
        if self.name == InterruptedStart.target:
            raise KeyboardInterrupt
        super().start()


# ---- a Ctrl-C inside a call ------------------------------------------------------------------


def test_an_interrupt_inside_step_leaves_the_lock_free_and_stop_working() -> None:
    """A Ctrl-C just after step queued its backup: the lock is free, stop drains."""
    service = build_service(make_config())
    put(service, A)
    queue_backup(service)
    service.controller.add_observer(interrupt_once(Direction.DEVICE_TO_HOST))
    with pytest.raises(KeyboardInterrupt):
        service.step()
    assert not service.service_lock.locked()
    service.stop()
    assert service.controller.num_in_flight == 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_an_interrupt_inside_step_leaks_no_host_slot(hybrid: bool) -> None:
    """After that Ctrl-C and a step, the node owns its host copy and no slot leaks."""
    service = build_service(make_config(hybrid=hybrid))
    try:
        put(service, A)
        queue_backup(service)
        service.controller.add_observer(interrupt_once(Direction.DEVICE_TO_HOST))
        with pytest.raises(KeyboardInterrupt):
            service.step()
        service.step()
        service.check_integrity()
        assert [n.host is not None for n in service.tree.nodes() if n.tokens == tuple(NEW)
                ] == [True]
    finally:
        stop_anyway(service)


def test_an_interrupt_inside_load_back_under_with_propagates_and_stops() -> None:
    """A Ctrl-C just after load_back queued its load: ``with`` raises it and stops."""
    service = build_service(make_config())
    try:
        with pytest.raises(KeyboardInterrupt), service:
            put(service, A)
            service.evict(10**6)
            service.controller.add_observer(interrupt_once(Direction.HOST_TO_DEVICE))
            service.load_back(service.match(A), 64)
        with pytest.raises(RuntimeError, match=r"^the service was stopped$"):
            service.match(A)
    finally:
        stop_anyway(service)


def test_an_interrupt_starting_the_background_thread_stops_everything(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C as start() starts its thread: ``with`` raises it, nothing is left serving."""
    port = free_port()
    service = build_service(make_config(metrics_port=port))
    monkeypatch.setattr(threading, "Thread", InterruptedStart)
    monkeypatch.setattr(InterruptedStart, "target", "hicache-service")
    try:
        with pytest.raises(KeyboardInterrupt), service:
            pass
        monkeypatch.undo()
        assert can_bind(port)
        with pytest.raises(RuntimeError, match=r"^the service was stopped$"):
            service.match(A)
    finally:
        monkeypatch.undo()
        if service.exporter is not None:
            service.exporter.stop()  # what stop should have closed


def test_an_interrupt_starting_the_metrics_thread_closes_the_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C as the endpoint starts its thread: the port is free while it is handled."""
    port = free_port()
    service = build_service(make_config(metrics_port=port))
    monkeypatch.setattr(threading, "Thread", InterruptedStart)
    monkeypatch.setattr(InterruptedStart, "target", "hicache-metrics-http")
    with pytest.raises(KeyboardInterrupt) as info, service:
        pass
    monkeypatch.undo()
    assert info.type is KeyboardInterrupt
    assert can_bind(port)


# ---- the background thread's failure ---------------------------------------------------------


def fail_on_the_background_thread(direction: Direction, transfers: object, tag: object
                                  ) -> None:
    """A tracer that lost its connection, called where the thread issues a backup."""
    if threading.current_thread().name == "hicache-service":
        raise ConnectionError("tracer lost its connection")


def failed_service(metrics_port: int | None = None) -> HiCacheService:
    """A started service whose thread failed issuing a backup no step issued (and ended:
    it logs the failure after counting it)."""
    service = build_service(make_config(metrics_port=metrics_port))
    service.controller.add_observer(fail_on_the_background_thread)
    service.start()
    fail_the_thread(service)
    return service


def fail_the_thread(service: HiCacheService) -> None:
    """Make the started ``service``'s thread fail (see :func:`failed_service`)."""
    held = service.alloc_device(2)
    assert held is not None
    service.insert([1, 1], held)  # no step: the idle thread issues the backup
    thread = service._poller._thread
    assert thread is not None
    wait_until(lambda: service.stats.background_errors == 1 and not thread.is_alive(),
               "the background failure")


def test_a_background_failure_surfaces_as_service_error_counted_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """The next call raises ServiceError with the cause; logged and counted once."""
    port = free_port()
    threads = set(threading.enumerate())
    with caplog.at_level(logging.ERROR, logger="hicache.background_poller"):
        service = failed_service(metrics_port=port)
    try:
        for _ in range(3):
            with pytest.raises(ServiceError) as info:
                service.match(A)
            assert str(info.value) == ("hicache background thread failed: ConnectionError("
                                       "'tracer lost its connection'); stop the service")
            assert type(info.value.__cause__) is ConnectionError
        assert [r.getMessage() for r in caplog.records] == ["hicache background thread failed"]
        assert service.exporter is not None
        lines = service.exporter.render().decode().split("\n")
        assert "hicache_background_errors_total 1.0" in lines
    finally:
        service.stop()  # surfaced already: returns quietly
    assert can_bind(port)
    assert set(threading.enumerate()) == threads


@pytest.mark.parametrize("op,args", [
    ("match", (A,)), ("alloc_device", (2,)), ("step", ()), ("evict", (2,)),
    ("start_loading", ()), ("wait_until", (0,)), ("start", ()),
])
def test_a_failed_service_refuses_every_call(op: str, args: tuple[object, ...]) -> None:
    """After the failure every call raises ServiceError, nothing runs."""
    service = failed_service()
    try:
        with pytest.raises(ServiceError, match=r"^hicache background thread failed: "):
            getattr(service, op)(*args)
    finally:
        service.stop()


def test_an_observer_error_inside_load_back_does_not_fail_the_idle_check_later() -> None:
    """A tracer's error inside load_back reaches the caller; no idle check fails later."""
    service = build_service(make_config(interval_s=0.05))
    try:
        put(service, A)
        service.evict(10**6)
        armed = [True]

        def tracer(direction: Direction, transfers: object, tag: object) -> None:
            if armed and direction is Direction.HOST_TO_DEVICE:
                armed.clear()
                raise ValueError("tracer bug")

        service.controller.add_observer(tracer)
        service.start()
        with pytest.raises(ValueError, match="tracer bug"):
            service.load_back(service.match(A), 64)
        wait_until(lambda: service.stats.integrity_checks + service.stats.background_errors
                   > 0, "an idle integrity check")
        assert service.stats.background_errors == 0
    finally:
        stop_anyway(service)


def test_an_unsurfaced_failure_is_raised_by_stop_once_and_stop_is_clean() -> None:
    """No call saw the failure: stop raises it once, after stopping everything."""
    port = free_port()
    threads = set(threading.enumerate())
    service = failed_service(metrics_port=port)
    with pytest.raises(ServiceError, match=r"ConnectionError\('tracer lost its connection'\)"):
        service.stop()
    service.stop()
    assert can_bind(port)
    assert set(threading.enumerate()) == threads
    with pytest.raises(RuntimeError, match=r"^host pool 'full' is closed$"):
        _ = service.controller.host_pool.data


def test_with_lets_the_body_exception_through_past_an_unsurfaced_failure() -> None:
    """``with`` raises the body's own error, not an unsurfaced background failure."""
    # the thread fails inside the body: entering ``with`` on a service that failed already
    # raises that failure (start, as every call, refuses a failed service), and no body runs
    service = build_service(make_config())
    service.controller.add_observer(fail_on_the_background_thread)
    try:
        with pytest.raises(KeyError, match="the engine's own") as info, service:
            fail_the_thread(service)
            raise KeyError("the engine's own")
        assert sys.version_info < (3, 11) or info.value.__notes__ == [
            "hicache background thread had failed too: ConnectionError('tracer lost its "
            "connection')"]
    finally:
        service.stop()  # the note surfaced it: returns quietly


# ---- stop from another thread, and in the middle of a check -------------------------------


def test_stop_on_another_thread_lets_the_call_in_progress_finish() -> None:
    """stop() on another thread mid-call: the call finishes, the next one is refused."""
    service = build_service(make_config())
    put(service, A)
    service.evict(10**6)
    service.start()
    stopper = threading.Thread(target=service.stop, name="stopper")

    def stop_meanwhile(direction: Direction, transfers: object, tag: object) -> None:
        if threading.current_thread() is threading.main_thread():
            stopper.start()
            wait_until(lambda: service._poller._stop_requested, "stop to begin")

    service.controller.add_observer(stop_meanwhile)
    try:
        assert service.load_back(service.match(A), 64).queued
    finally:
        stopper.join(timeout=30)
    assert not stopper.is_alive()
    assert [(n.tokens, n.on_device, n.lock_count) for n in service.tree.nodes()] == [
        (tuple(A), True, 0)]
    with pytest.raises(RuntimeError, match=r"^the service was stopped$"):
        service.step()


def test_a_call_admitted_while_stop_runs_on_another_thread_is_refused() -> None:
    """A call that starts while stop() runs on another thread is refused, not run."""
    service = build_service(make_config())
    queue_backup(service)  # stop issues it under the lock: the observer pauses stop there
    calls = service._gate.num_calls
    in_stop = threading.Event()

    def hold_stop(direction: Direction, transfers: object, tag: object) -> None:
        if threading.current_thread().name == "stopper":
            in_stop.set()
            wait_until(lambda: service._gate.num_calls > calls, "the call to be admitted")

    service.controller.add_observer(hold_stop)
    stopper = threading.Thread(target=service.stop, name="stopper")
    stopper.start()
    assert in_stop.wait(timeout=30)
    try:
        with pytest.raises(RuntimeError, match=r"^the service was stopped$"):
            service.alloc_device(2)
    finally:
        stopper.join(timeout=30)
    assert service.engine_held_tokens == 0 and not stopper.is_alive()


def test_stop_in_the_middle_of_an_integrity_check_is_clean() -> None:
    """stop joins a thread held between two slices of a check; the tree is consistent."""
    service = build_service(make_config(interval_s=0.0))
    for first in range(8):
        put(service, [first, first])
    wait_until(lambda: service.step() == 0 and service.controller.num_in_flight == 0,
               "the backups' acks")
    service.background_check.slice_s = 0.0  # one node a slice: a check spans 8 slices
    service.start()
    thread = service._poller._thread
    assert thread is not None
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline, "no check in progress"
        service.service_lock.acquire()
        if service.background_check.in_progress:
            break
        service.service_lock.release()
        time.sleep(0.0002)
    completed = service.background_check.stats.completed
    stopper = threading.Thread(target=service.stop, name="stopper")
    try:
        stopper.start()
        wait_until(lambda: not service._poller.is_running, "stop to join the thread")
        assert service.background_check.in_progress
    finally:
        service.service_lock.release()
    stopper.join(timeout=30)
    assert not stopper.is_alive()
    assert service.background_check.stats.completed == completed
    assert not thread.is_alive()
    service.check_integrity()


# ---- the shared store (L3) -------------------------------------------------------------------


def test_stop_finishes_a_prefetch_and_stores_the_queued_backups(tmp_path: Path) -> None:
    """stop finishes an open prefetch and stores unissued backups (read back by another)."""
    store = file_store(tmp_path / "l3", prefetch_policy="wait_complete")
    first = build_service(make_config(storage=store), **MODEL)
    put_rows(first, list(range(100, 120)))
    settle(first)
    first.stop()
    before = footprint()
    service = build_service(make_config(storage=store), **MODEL)
    key = service.key(list(range(100, 120)))
    prefetch = service.prefetch(key, service.match(key))
    assert prefetch is not None
    put_rows(service, list(range(200, 220)))  # its host backup queued, no step
    service.stop()
    assert prefetch.finished
    assert not any(n.lock_count for n in service.tree.nodes())
    service.check_integrity()
    del service, prefetch
    assert footprint() == before
    reader = build_service(make_config(storage=store), **MODEL)
    try:
        tokens = list(range(200, 220))
        attached, device = fetch(reader, tokens)
        pool = pool_of(reader)
        assert attached == 20
        assert torch.equal(read_rows(pool, device.tensor), expected_rows(tokens, pool.num_layers))
    finally:
        reader.stop()


def test_an_unreachable_redis_store_serves_misses_and_stops_clean(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No server at storage.url: the prefetch's pages counted as the store's error (a dead
    store is not an empty one), and stop leaves nothing behind."""
    # the store's warning carries the connection error, whose traceback holds the worker's
    # frames; the test's log capture keeps every record, so it would keep them alive
    monkeypatch.setattr(logging.getLogger("hicache.storage"), "propagate", False)
    before = footprint()
    store = {"backend": "redis", "url": f"redis://127.0.0.1:{free_port()}", "timeout_s": 0.5,
             "prefetch_threshold_tokens": 0, "prefetch_policy": "wait_complete"}
    with build_service(make_config(storage=store), **MODEL) as service:
        tier = service.storage
        assert tier is not None
        put(service, A)
        key = service.key(list(range(100, 110)))
        prefetch = service.prefetch(key, service.match(key))
        assert prefetch is not None
        assert service.wait_prefetch(prefetch, timeout_s=30)
        assert service.finish_prefetch(prefetch) == 0
    assert dict(tier.stats.prefetch_tokens) == {"error": 10}
    assert tier.stats.backup_pages["failed"] == len(A) // 2
    assert tier.stats.backup_pages["stored"] == 0
    del service, tier, prefetch
    assert footprint() == before
