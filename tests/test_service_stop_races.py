"""Audit of the service's life cycle across threads (an operator's thread beside the engine's).

- A call that passed the gate's ``stopped`` check just before ``stop`` began on another
  thread, and took the lock after ``stop`` released it, ran on the closed service: it handed
  out slots, queued a backup or a load no one would issue, or failed deep in a closed pool.
- Two ``stop`` calls at once: the second read the thread it joins twice and could call
  ``None.join()``; a ``start`` past its checks when a ``stop`` ran left the metrics endpoint
  serving after ``stop`` returned. ``start`` and ``stop`` now take turns.
- ``check_integrity`` of a hybrid service on a tool's thread compared the slot map with the
  allocators outside the lock, while the scheduler changed them: false failures.
- A connection to the metrics endpoint that sent nothing held a thread and a socket for
  good, past ``stop``.

The interleavings are placed with a trace function that pauses one thread at a chosen line
(nothing of the project is replaced).
"""

from __future__ import annotations

import linecache
import random
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hicache import lifecycle
from hicache.background_poller import BackgroundPoller
from hicache.call_gate import CallGate
from hicache.config import config_from_dict
from hicache.factory import build_service
from hicache.metrics import MetricsExporter, http_server
from hicache.pools import IndexSpace, Indices
from hicache.service import HiCacheService

LIVENESS_S = 20.0
PAGE = 2


def make_service(policy: str = "write_through", *, metrics: bool = False,
                 hybrid: bool = False, interval_s: float = 0.01) -> HiCacheService:
    model: dict[str, Any] = {"num_layers": 2, "attention": "mha", "num_kv_heads": 1,
                             "head_dim": 2, "dtype": "float32"}
    pool: dict[str, Any] = {"num_tokens": 32, "device": "cpu"}
    if hybrid:
        model.update(swa_layers=[1], window_tokens=3)
        pool["swa_num_tokens"] = 16
    return build_service(config_from_dict({
        "page_size_tokens": PAGE, "model": model, "device_pool": pool,
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": policy,
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": metrics, "metrics_port": 0,
                    "integrity_check_interval_s": interval_s},
    }))


def line_of(frame: Any) -> str:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


class Pause:
    """Pause the thread that runs :meth:`run` once, where ``stop_at(frame, event)`` says (in
    a call of ``code``), until :meth:`resume`."""

    def __init__(self, code: Any, stop_at: Callable[[Any, str], bool]) -> None:
        self.code, self.stop_at = code, stop_at
        self.paused, self._resume = threading.Event(), threading.Event()
        self.outcome: list[tuple[str, Any]] = []
        self._armed = True

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "call" or frame.f_code is not self.code:
            return None

        def local(inner: Any, inner_event: str, _: Any) -> Any:
            if self._armed and self.stop_at(inner, inner_event):
                self._armed = False
                self.paused.set()
                self._resume.wait(LIVENESS_S)
            return local
        return local

    def run(self, call: Callable[[], Any]) -> threading.Thread:
        def body() -> None:
            sys.settrace(self._trace)
            try:
                self.outcome.append(("ok", call()))
            except BaseException as error:
                self.outcome.append(("err", error))
            finally:
                sys.settrace(None)

        thread = threading.Thread(target=body)
        thread.start()
        assert self.paused.wait(LIVENESS_S)
        return thread

    def resume(self, thread: threading.Thread) -> None:
        self._resume.set()
        thread.join(LIVENESS_S)
        assert not thread.is_alive()


def after_the_gate(service: HiCacheService, call: Callable[[], Any]) -> tuple[str, Any]:
    """``call`` on a scheduler thread held right after the gate admitted it (before it takes
    the lock), while ``stop`` runs to the end on this thread."""
    pause = Pause(CallGate.call.__code__, lambda _, event: event == "return")
    thread = pause.run(call)
    service.stop()
    assert service._gate.closed
    pause.resume(thread)
    return pause.outcome[0]


def assert_refused(outcome: tuple[str, Any]) -> None:
    kind, result = outcome
    assert kind == "err", f"the call ran on the stopped service: {result!r}"
    assert isinstance(result, RuntimeError) and str(result) == "the service was stopped"


def test_alloc_device_admitted_before_stop_is_refused_after_it() -> None:
    service = make_service()
    service.start()
    assert_refused(after_the_gate(service, lambda: service.alloc_device(8)))
    assert service.engine_held_tokens == 0


def test_insert_admitted_before_stop_queues_nothing() -> None:
    service = make_service()
    service.start()
    slots = service.alloc_device(8)
    assert_refused(after_the_gate(service, lambda: service.insert([2] * 8, slots)))
    assert not service.tree.queued_backups


def test_load_back_admitted_before_stop_queues_no_load() -> None:
    service = make_service("write_back")
    service.start()
    slots = service.alloc_device(8)
    service.insert([1] * 8, slots)
    service.step()
    service.evict(8)
    for _ in range(50):
        service.step()
        time.sleep(0.001)
    match = service.match([1] * 8)
    assert match.host_hit_tokens == 8
    service.lock(match.last_host_node)
    assert_refused(after_the_gate(service, lambda: service.load_back(match, 64)))
    assert service.controller.num_in_flight == 0


def test_evict_admitted_before_stop_is_refused_not_failed_in_a_closed_pool() -> None:
    service = make_service("write_back")
    service.start()
    slots = service.alloc_device(8)
    service.insert([1] * 8, slots)
    service.step()
    assert_refused(after_the_gate(service, lambda: service.evict(8)))


def at_join(frame: Any, event: str) -> bool:
    return event == "line" and ".join()" in line_of(frame)


@pytest.mark.parametrize("code", [BackgroundPoller.stop.__code__,
                                  MetricsExporter._stop_serving.__code__],
                         ids=["poller", "exporter"])
def test_two_stops_at_once_take_turns(code: Any) -> None:
    """One stop is paused at its thread join; a second one on another thread waits for it
    (not a ``None.join()``), and both return with nothing left running."""
    service = make_service(metrics=True)
    before = set(threading.enumerate())
    service.start()
    pause = Pause(code, at_join)
    first = pause.run(service.stop)
    second_outcome: list[BaseException | None] = []

    def second_stop() -> None:
        try:
            service.stop()
            second_outcome.append(None)
        except BaseException as error:
            second_outcome.append(error)

    second = threading.Thread(target=second_stop)
    second.start()
    time.sleep(0.2)
    assert second.is_alive()  # it waits for the first
    pause.resume(first)
    second.join(LIVENESS_S)
    assert pause.outcome == [("ok", None)] and second_outcome == [None]
    assert service._gate.closed and service.exporter is not None
    assert service.exporter.port is None
    assert not [t for t in threading.enumerate()
                if t not in before and t.name.startswith("hicache")]


def test_an_exporter_stopped_twice_at_once_raises_nothing() -> None:
    service = make_service(metrics=True)
    service.start()
    exporter = service.exporter
    assert exporter is not None
    pause = Pause(MetricsExporter._stop_serving.__code__, at_join)
    first = pause.run(exporter.stop)
    exporter.stop()  # the whole stop, while the first waits at its join
    pause.resume(first)
    assert pause.outcome == [("ok", None)] and exporter.port is None
    service.stop()


def test_a_stop_while_start_runs_closes_what_start_started() -> None:
    service = make_service(metrics=True)
    before = set(threading.enumerate())
    pause = Pause(lifecycle.start.__code__,
                  lambda frame, event: event == "line" and "exporter, address" in line_of(frame))
    starter = pause.run(service.start)
    stopper = threading.Thread(target=service.stop)
    stopper.start()
    time.sleep(0.2)
    assert stopper.is_alive()  # waits for the start
    pause.resume(starter)
    stopper.join(LIVENESS_S)
    assert not stopper.is_alive() and pause.outcome == [("ok", None)]
    time.sleep(0.2)
    left = [t.name for t in threading.enumerate()
            if t not in before and t.name.startswith("hicache")]
    assert left == [] and service.exporter is not None and service.exporter.port is None
    with pytest.raises(RuntimeError, match="the service was stopped"):
        service.start()


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    yield
    sys.setswitchinterval(before)


def scheduler_loop(service: HiCacheService, done: threading.Event, errors: list[str]) -> None:
    rng = random.Random(7)
    try:
        while not done.is_set():
            tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 12))]
            match = service.match(tokens)
            node = match.last_device_node
            service.lock(node)
            own = service.alloc_device(len(tokens) - len(match.device_indices))
            if own is not None:
                slots = Indices(torch.cat([match.device_indices.tensor, own.tensor]),
                                IndexSpace.DEVICE_FULL)
                service.insert(tokens, slots)
                whole = len(tokens) // PAGE * PAGE
                if len(slots) > whole:
                    service.free_device(Indices(slots.tensor[whole:], IndexSpace.DEVICE_FULL))
            service.release(node)
            service.step()
            if rng.random() < 0.3:
                service.evict(rng.randrange(1, 12))
            if rng.random() < 0.1:
                service.evict_host(rng.randrange(1, 12))
    except BaseException as error:
        errors.append(f"scheduler: {error!r}")


@pytest.mark.usefixtures("frequent_switches")
@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_check_integrity_on_a_tool_thread_beside_the_scheduler(hybrid: bool) -> None:
    service = make_service(hybrid=hybrid, interval_s=3600.0)
    service.start()
    done, errors = threading.Event(), []
    scheduler = threading.Thread(target=scheduler_loop, args=(service, done, errors))
    scheduler.start()
    checks, deadline = 0, time.monotonic() + 6.0
    try:
        while time.monotonic() < deadline and not errors:
            try:
                service.check_integrity()
                checks += 1
            except RuntimeError as error:
                errors.append(f"check_integrity #{checks}: {error}")
            time.sleep(0.0005)
    finally:
        done.set()
        scheduler.join(30)
    service.check_integrity()
    service.stop()
    assert not errors, errors[:3]
    assert checks > 50


def test_a_silent_connection_to_the_metrics_endpoint_ends_after_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_server.QuietHandler, "timeout", 0.5)
    service = make_service(metrics=True)
    before = set(threading.enumerate())
    service.start()
    assert service.exporter is not None and service.exporter.port is not None
    port = service.exporter.port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200  # scrapes are served meanwhile
        service.stop()
        deadline = time.monotonic() + 5.0
        while [t for t in threading.enumerate() if t not in before]:
            assert time.monotonic() < deadline, "request threads outlived stop()"
            time.sleep(0.05)
        idle[0].settimeout(1.0)
        assert idle[0].recv(1) == b""  # the endpoint closed its side
    finally:
        for connection in idle:
            connection.close()


def test_the_request_timeout_is_a_few_seconds() -> None:
    assert http_server.QuietHandler.timeout == http_server.REQUEST_TIMEOUT_S == 5.0
