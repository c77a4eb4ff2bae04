"""HiCacheService on a CPU: factory, a scheduler thread beside the background thread, stop
with ops in flight, background errors, life cycle."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from gpu_shapes import scaled
from radix_helpers import expected_rows, read_rows, write_rows
from thread_helpers import service_thread_names

from hicache.config import HiCacheConfig, config_from_dict
from hicache.controller import HybridCacheController
from hicache.factory import build_service
from hicache.pools import DeviceKVPool, HybridSWAPool, IndexSpace, Indices
from hicache.radix import TreeNode
from hicache.service import HiCacheService, ServiceError

PAGE = 2
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_config(policy: str = "write_through", hybrid: bool = False, interval_s: float = 1.0,
                device: str = "cpu", io_backend: str = "torch", metrics: bool = False,
                metrics_port: int = 0) -> HiCacheConfig:
    """A 2-layer model, 32 device tokens in pages of 2 (16 SWA tokens when hybrid), host
    twice as large; metrics only when asked for (port 0: a free one)."""
    model: dict[str, Any] = {"num_layers": 2, "attention": "mha", "num_kv_heads": 1,
                             "head_dim": 2, "dtype": "float32"}
    pool: dict[str, Any] = {"num_tokens": 32, "device": device}
    if hybrid:
        model.update(swa_layers=[1], window_tokens=3)
        pool["swa_num_tokens"] = 16
    return config_from_dict({
        "page_size_tokens": PAGE, "model": model, "device_pool": pool,
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": io_backend, "write_policy": policy,
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": metrics, "metrics_port": metrics_port,
                    "integrity_check_interval_s": interval_s},
    })


def full_pool(service: HiCacheService) -> DeviceKVPool:
    pool = service.device_pool
    return pool.full if isinstance(pool, HybridSWAPool) else pool


def put(service: HiCacheService, tokens: list[int]) -> bool:
    """Engine step: allocate, write rows, insert, give back the partial tail page."""
    slots = service.alloc_device(len(tokens))
    if slots is None:
        return False
    pool = full_pool(service)
    write_rows(pool, slots.tensor[:len(tokens)], expected_rows(tokens, pool.num_layers))
    service.insert(tokens, slots)
    whole = len(tokens) // PAGE * PAGE
    if len(slots) > whole:
        service.free_device(Indices(slots.tensor[whole:], IndexSpace.DEVICE_FULL))
    reuse(slots)
    return True


def reuse(slots: Indices) -> None:
    """The engine reuses a slot tensor the service handed it (or took from it) as its own
    buffer: every value moved to another page in place. Nothing the service keeps may
    share it (the integrity checks would find the pages renamed)."""
    slots.tensor.add_(PAGE)


def rows_ok(service: HiCacheService, tokens: list[int], slots: Indices) -> bool:
    pool = full_pool(service)
    expected = expected_rows(tokens[:len(slots)], pool.num_layers)
    return torch.equal(read_rows(pool, slots.tensor), expected)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the background thread"
        time.sleep(0.002)


def empty_everything(service: HiCacheService) -> None:
    """Apply acks and evict both tiers until nothing is cached (write-back needs rounds: a
    device eviction queues a backup first). Rounds go on while copies are in flight, which
    under a sanitizer can take many rounds, up to a deadline."""
    deadline = time.monotonic() + 60.0
    while True:
        service.step()
        service.evict(10**6)
        service.step()
        service.evict_host(10**6)
        if not list(service.tree.nodes()) and service.controller.num_in_flight == 0:
            return
        if time.monotonic() > deadline:
            return  # the caller's checks name what is left
        time.sleep(0.001)


@pytest.fixture
def plain() -> Iterator[HiCacheService]:
    service = build_service(make_config())
    yield service
    service.stop()


# ---- factory ------------------------------------------------------------------------------


def test_factory_builds_plain_and_hybrid_services() -> None:
    """Pools sized from the config, the layer waiter registered, nothing started."""
    for hybrid in (False, True):
        service = build_service(make_config(hybrid=hybrid))
        controller = service.controller
        assert isinstance(controller, HybridCacheController) is hybrid
        assert controller.device_allocator.capacity_tokens == 32
        assert controller.host_pool.allocator.capacity_tokens == 64
        assert service.device_pool._layer_waiter == controller.wait_until
        assert "hicache-service" not in service_thread_names()
        service.stop()


# ---- concurrency --------------------------------------------------------------------------


def scheduler_ops(service: HiCacheService, seed: int, num_ops: int, steps: bool = True
                  ) -> int:
    """Random engine traffic on this thread; checks rows of every match as it goes, and
    reuses every slot tensor the service handed out once done with it (:func:`reuse`). A batch
    that loads waits for every layer (as its forward pass would) before rows are read.
    Without ``steps`` the scheduler never polls: where it would step it sleeps a little (a
    forward pass), and the background thread acknowledges every transfer; every
    :data:`QUIET_EVERY` operations a longer pass with transfers in flight waits until the
    thread polled them (it must within :data:`THREAD_POLL_DEADLINE_S`). Returns how many
    such waits there were."""
    rng = random.Random(seed)
    locked: list[TreeNode] = []
    waits = 0
    for done in range(num_ops):
        if not steps and done % QUIET_EVERY == QUIET_EVERY - 1:
            waits += wait_for_thread_poll(service)
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 11))]
        op = rng.random()
        if op < 0.3:
            put(service, tokens)
        elif op < 0.5:
            match = service.match(tokens)
            assert rows_ok(service, tokens, match.device_indices)
            reuse(match.device_indices)
        elif op < 0.65:
            match = service.match(tokens)
            loaded = service.load_back(match, 16) if match.host_hit_tokens else None
            reuse(match.device_indices)
            if loaded is not None and loaded.queued:
                reuse(loaded.device_indices)  # before the op is issued: it owns a copy
                service.start_loading()
                for layer in range(service.controller.num_layers):
                    service.wait_until(layer)
        elif op < 0.75:
            match = service.match(tokens)
            service.lock(match.last_device_node)
            locked.append(match.last_device_node)
        elif op < 0.85 and locked:
            service.release(locked.pop(rng.randrange(len(locked))))
        elif op < 0.92:
            service.evict(rng.randrange(1, 12))
        elif steps:
            service.step()
        else:
            time.sleep(0.0002)
    for node in locked:
        service.release(node)
    return waits


QUIET_EVERY = 100
THREAD_POLL_DEADLINE_S = 30.0


def wait_for_thread_poll(service: HiCacheService) -> int:
    """A quiet scheduler with transfers queued or in flight (or backups its tree queued):
    the background thread must poll within the deadline. 1 when there was something to
    wait for, else 0."""
    if service.controller.num_in_flight == 0 and not service.tree.has_queued_backups:
        return 0
    polls = service.stats.polls
    deadline = time.monotonic() + THREAD_POLL_DEADLINE_S
    while service.stats.polls == polls:
        assert time.monotonic() < deadline, "the background thread never polled"
        time.sleep(0.001)
    return 1


def run_random_traffic(service: HiCacheService, seed: int, num_ops: int, steps: bool = True
                       ) -> None:
    """Scheduler thread beside the background thread, then empty the cache: no slot leaked
    and none owned twice. Without ``steps`` (see :func:`scheduler_ops`) the thread's polls
    run beside the scheduler's calls. The service is stopped whatever happens, so that a
    failure here leaves no thread behind for the tests after it."""
    service.start()
    try:
        errors: list[BaseException] = []
        waits: list[int] = []

        def run() -> None:
            try:
                waits.append(scheduler_ops(service, seed=seed, num_ops=num_ops, steps=steps))
            except BaseException as exc:
                errors.append(exc)

        scheduler = threading.Thread(target=run)
        scheduler.start()
        scheduler.join()
        assert not errors, errors
        service.check_integrity()
        assert service.stats.background_passes > 0 and service.stats.integrity_checks > 0
        if not steps:  # each wait saw a poll; some of the seed's quiet passes had work
            assert waits[0] > 0 and service.stats.polls >= waits[0]
        empty_everything(service)
        service.check_integrity()
        assert not list(service.tree.nodes()) and service.engine_held_tokens == 0
        for space, allocator in service.tree.io.allocators().items():
            assert allocator.num_free_tokens == allocator.capacity_tokens, f"{space} leaked"
    finally:
        service.stop()
    assert service.stats.background_errors == 0


@pytest.mark.parametrize("policy,hybrid,seed,steps", [
    ("write_through", False, 1, True), ("write_through_selective", False, 2, False),
    ("write_back", False, 3, True), ("write_through", True, 4, False),
    ("write_back", True, 5, False),
])
def test_random_traffic_beside_the_background_thread(policy: str, hybrid: bool, seed: int,
                                                     steps: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of operations on a CPU. The thread's busy backoff is capped at 20 ms here, so
    that it passes often beside the scheduler's calls and a quiet pass's wait is short."""
    monkeypatch.setattr("hicache.background_poller.BUSY_WAKE_S", 0.02)
    config = make_config(policy, hybrid, interval_s=0.005)
    run_random_traffic(build_service(config), seed, 2500, steps)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("policy,hybrid,backend,steps", [
    ("write_through", False, "auto", True), ("write_back", False, "kernel", False),
    ("write_through_selective", False, "staged", True), ("write_through", True, "auto", False),
    ("write_back", True, "torch", True),
])
def test_random_traffic_on_a_gpu(policy: str, hybrid: bool, backend: str, steps: bool,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The same traffic with real asynchronous copies; loaded rows checked after the waits.
    The thread's busy backoff is capped at 20 ms, as on the CPU."""
    monkeypatch.setattr("hicache.background_poller.BUSY_WAKE_S", 0.02)
    config = make_config(policy, hybrid, interval_s=0.005, device="cuda", io_backend=backend)
    run_random_traffic(build_service(config), seed=5, num_ops=scaled(1500, 300), steps=steps)


@pytest.mark.gpu
@needs_cuda
def test_stop_on_a_gpu_finishes_queued_and_running_copies() -> None:
    """Writes still running and loads never started are finished by stop()."""
    service = build_service(make_config(device="cuda", io_backend="auto"))
    for first in range(3):
        assert put(service, [first, first, 9, 9, 8, 8])
    service.step()
    service.evict(10**6)
    assert put(service, [7, 7, 7, 7])
    assert service.load_back(service.match([0, 0, 9, 9, 8, 8]), 16).queued
    service.stop()
    assert all(not n.is_in_flight and n.is_backed_up for n in service.tree.nodes())
    assert service.controller.num_in_flight == 0
    service.check_integrity()


def test_stop_with_transfers_in_flight_loses_nothing(plain: HiCacheService) -> None:
    """Unapplied write acks and queued loads are finished and applied by stop()."""
    plain.start()
    for first in range(4):
        assert put(plain, [first, first, 9, 9])
    plain.step()
    plain.evict(10**6)
    assert put(plain, [7, 7, 7, 7])  # its write is not acknowledged yet
    match = plain.match([0, 0, 9, 9])
    assert plain.load_back(match, 16).queued  # queued, never started
    plain.stop()
    nodes = list(plain.tree.nodes())
    assert all(not n.is_in_flight and n.is_backed_up and n.lock_count == 0 for n in nodes)
    assert plain.tree.stats.backed_up_tokens == 20 and plain.controller.num_in_flight == 0
    plain.check_integrity()
    plain.tree.evict(10**6)
    plain.tree.evict_host(10**6)
    for allocator in plain.tree.io.allocators().values():
        assert allocator.num_free_tokens == allocator.capacity_tokens


# ---- background errors --------------------------------------------------------------------


def _fail(*_: object) -> list[object]:
    raise RuntimeError("boom")


def test_background_error_surfaces_on_the_next_call(
    plain: HiCacheService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing poll is counted and raised, wrapped, by every later scheduler call."""
    assert put(plain, [1, 1])  # a backup in flight: the thread's first pass polls
    monkeypatch.setattr(plain.controller, "poll_acks", _fail)
    plain.start()
    wait_for(lambda: plain.stats.background_errors == 1)
    for _ in range(2):
        with pytest.raises(ServiceError) as caught:
            plain.match([1, 1])
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert str(caught.value.__cause__) == "boom"
    monkeypatch.undo()
    plain.stop()  # already surfaced: stop does not raise it again


def test_unsurfaced_background_error_is_raised_by_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    service = build_service(make_config())
    assert put(service, [1, 1])  # a backup in flight: the thread's first pass polls
    monkeypatch.setattr(service.controller, "poll_acks", _fail)
    service.start()
    wait_for(lambda: service.stats.background_errors == 1)
    monkeypatch.undo()
    with pytest.raises(ServiceError):
        service.stop()


def test_idle_integrity_check_catches_a_planted_double_owner() -> None:
    """The background check runs when idle and reports a corrupted tree."""
    service = build_service(make_config(interval_s=0.0))
    assert put(service, [1, 1]) and put(service, [2, 2])
    service.step()
    nodes = {node.tokens: node for node in service.tree.nodes()}
    with service.service_lock:
        nodes[(2, 2)].device = nodes[(1, 1)].device
    service.start()
    wait_for(lambda: service.stats.background_errors == 1)
    with pytest.raises(ServiceError, match="owned by nodes"):
        service.step()
    with service.service_lock:
        nodes[(2, 2)].device = Indices(torch.tensor([4, 5]), IndexSpace.DEVICE_FULL)
    service.stop()


def test_integrity_check_waits_while_the_scheduler_keeps_calling() -> None:
    """A scheduler that only matches (no acks) is never made to wait for the idle check:
    none runs while it calls, one runs once it stops."""
    service = build_service(make_config(interval_s=0.05))
    assert put(service, [1, 1])
    service.step()
    service.start()
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        service.match([1, 1])
        time.sleep(0.002)
    assert service.stats.integrity_checks == 0
    wait_for(lambda: service.stats.integrity_checks > 0)
    service.stop()


def test_an_idle_thread_sleeps_until_a_transfer_is_queued() -> None:
    """With nothing in flight and no check due the thread does not wake every poll
    interval (each wake takes the GIL from the scheduler); a queued backup wakes it, and it
    acknowledges the copy without a scheduler call."""
    service = build_service(make_config(interval_s=3600.0))
    service.start()
    wait_for(lambda: service.stats.background_passes >= 1)  # the first, before any sleep
    time.sleep(0.1)  # a hundred poll intervals
    assert service.stats.background_passes == 1
    assert service.stats.polls == 0  # nothing in flight: nothing to poll
    assert put(service, [1, 1])  # write-through: a backup is queued and issued
    wait_for(lambda: service.stats.polls >= 1)
    wait_for(lambda: service.controller.num_in_flight == 0)  # acknowledged by the thread
    assert service.step() == 1  # the ack it queued applies here
    assert [node.host is not None for node in service.tree.nodes()] == [True]
    started = time.monotonic()
    service.stop()  # wakes the sleeping thread: no wait for the hour-long check interval
    assert time.monotonic() - started < 2.0


def test_a_queued_transfer_is_polled_one_interval_later() -> None:
    """A wake by a queued transfer does not poll at once (the transfer was only just
    queued, and the scheduler thread is still issuing it): the first poll comes a poll
    interval later, and then acknowledges the copy."""
    service = build_service(make_config(interval_s=3600.0))
    service._poller._poll_interval_s = 0.5  # long enough to see the wait
    service.start()
    try:  # a failure still stops the thread (else the teardown reports it as left running)
        wait_for(lambda: service.stats.background_passes >= 1)
        queued = time.monotonic()
        assert put(service, [1, 1])  # write-through: a backup is queued (the thread issues it)
        time.sleep(0.2)
        assert service.stats.polls == 0 and service.tree.has_queued_backups
        # the count first: the thread counts its poll after issuing and acknowledging the
        # copy, so the queue and the in-flight count can read empty just before it
        wait_for(lambda: service.stats.polls >= 1)
        assert time.monotonic() - queued >= 0.5
        assert not service.tree.has_queued_backups and service.controller.num_in_flight == 0
        assert service.stats.polls == 1
    finally:
        service.stop()


# ---- engine contract and life cycle -------------------------------------------------------


def test_insert_and_free_refuse_pages_the_engine_does_not_hold(plain: HiCacheService) -> None:
    assert put(plain, [1, 1, 2, 2])
    foreign = plain.controller.device_allocator.try_alloc(2)  # behind the service's back
    assert foreign is not None
    with pytest.raises(ValueError, match="neither held by the engine"):
        plain.insert([3, 3], foreign)
    with pytest.raises(ValueError, match="not handed out"):
        plain.free_device(foreign)
    plain.controller.device_allocator.free(foreign)
    own = plain.match([1, 1, 2, 2]).device_indices
    assert plain.insert([1, 1, 2, 2], own) == 4  # the tree's own slots are fine
    plain.check_integrity()


def test_alloc_device_evicts_when_full(plain: HiCacheService) -> None:
    for first in range(8):
        assert put(plain, [first, first, 5, 5])
    assert plain.controller.device_allocator.num_free_tokens == 0
    plain.step()
    slots = plain.alloc_device(4)
    assert slots is not None and plain.engine_held_tokens == 4
    plain.free_device(slots)
    plain.check_integrity()


def test_context_manager_stops_the_thread_and_stop_is_idempotent() -> None:
    with build_service(make_config()) as service:
        assert "hicache-service" in service_thread_names()
        assert put(service, [1, 1])
    assert "hicache-service" not in service_thread_names()
    service.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        service.match([1, 1])
    service.check_integrity()


def test_metrics_endpoint_lives_from_start_to_stop() -> None:
    """With metrics enabled the endpoint binds a free port at start and closes at stop."""
    service = build_service(make_config(metrics=True))
    assert service.exporter is not None and service.exporter.port is None
    with service:
        assert put(service, [1, 1, 2, 2])
        assert service.exporter.port is not None
        text = service.exporter.render().decode()
        assert "hicache_inserted_tokens_total 4.0" in text.splitlines()
    assert service.exporter.port is None


def test_interrupt_inside_start_stops_what_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands in start(), after the metrics endpoint is up and before the
    thread runs: ``with service`` never reaches __exit__, so __enter__ stops the service
    itself (no endpoint thread left, the port closed)."""
    service = build_service(make_config(metrics=True, metrics_port=0))

    class InterruptedThread(threading.Thread):
        def start(self) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr("hicache.service.threading.Thread", InterruptedThread)
    with pytest.raises(KeyboardInterrupt), service:
        pass
    assert not service_thread_names()
    with pytest.raises(RuntimeError, match="stopped"):
        service.match([1, 2])
