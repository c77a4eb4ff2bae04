"""Concurrency stress of HiCacheService on a CPU, under its threading contract: one scheduler
thread makes every service call, the service's background thread polls, issues the backups
a quiet scheduler left queued and runs its sliced integrity check, and metrics readers (the
Prometheus endpoint's HTTP threads, and plain reads of the counters) run beside both.

Every test asserts exact invariants rather than timings: slot conservation
(``check_integrity``, and every pool empty once everything is evicted), every op submitted
acknowledged and applied once, every counter the scheduler can predict equal to what it
predicted (tokens counted once, by the scrape too), counters that never go backwards from
one scrape to the next, a clean ``stop`` while a scrape and a poll wait for the lock, and
background failures surfacing. Waits on the background thread have a generous deadline only
so that a hang fails instead of blocking the run.

Four races were found here, each pinned with its interleaving placed deterministically:

- a match's host-only run removed by the background thread before the scheduler locks it
  (fixed: the thread issues only the backups that fit the host as it is, evicting nothing);
- ``check_integrity`` failing spuriously while the background thread issues a backup
  (fixed: the allocators are checked under the lock only);
- ``TransferStats.in_flight_ops`` negative for a reader without the lock (fixed: the
  acknowledgements are read first);
- the sliced check walking on after a call that counted itself before its check started
  (fixed: a slice's finding is confirmed by the full check in one hold of the lock before
  anything is raised; one the full check does not confirm is counted as unconfirmed). On
  CPython with the GIL the gap between the count and the lock has no switch point but a
  finalizer, so the race was latent; the last two tests below place it by hand.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from radix_helpers import expected_rows, read_rows, write_rows
from test_service import empty_everything

from hicache.config import HiCacheConfig, config_from_dict
from hicache.controller import Ack, TransferStats
from hicache.controller.base import Direction
from hicache.factory import build_service
from hicache.pools import DeviceKVPool, HybridSWAPool, IndexSpace, Indices
from hicache.radix import TreeNode
from hicache.service import HiCacheService, ServiceError

PAGE = 2
D2H, H2D = "device_to_host", "host_to_device"
LIVENESS_S = 60.0  # a deadline for waits on another thread: only a hang reaches it

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# ---- building services --------------------------------------------------------------------


def make_config(policy: str, *, hybrid: bool = False, interval_s: float = 0.002,
                metrics: bool = True, device_tokens: int = 32,
                host_ratio: float = 1.0) -> HiCacheConfig:
    """A 2-layer CPU model in pages of 2 tokens; small pools (eviction on both tiers all
    the time); metrics on a free port."""
    model: dict[str, Any] = {"num_layers": 2, "attention": "mha", "num_kv_heads": 1,
                             "head_dim": 2, "dtype": "float32"}
    pool: dict[str, Any] = {"num_tokens": device_tokens, "device": "cpu"}
    if hybrid:
        model.update(swa_layers=[1], window_tokens=3)
        pool["swa_num_tokens"] = device_tokens // 2
    return config_from_dict({
        "page_size_tokens": PAGE, "model": model, "device_pool": pool,
        "host": {"ratio": host_ratio, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": policy,
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": metrics, "metrics_port": 0,
                    "integrity_check_interval_s": interval_s},
    })


def full_pool(service: HiCacheService) -> DeviceKVPool:
    pool = service.device_pool
    return pool.full if isinstance(pool, HybridSWAPool) else pool


def rows_ok(service: HiCacheService, tokens: list[int], slots: Indices) -> bool:
    pool = full_pool(service)
    expected = expected_rows(tokens[:len(slots)], pool.num_layers)
    return torch.equal(read_rows(pool, slots.tensor), expected)


def cat(a: Indices, b: Indices) -> Indices:
    return Indices(torch.cat([a.tensor, b.tensor]), IndexSpace.DEVICE_FULL)


def put(service: HiCacheService, tokens: list[int]) -> None:
    """Allocate, write the rows, insert (write-through: the backup is queued, not issued)."""
    slots = service.alloc_device(len(tokens))
    assert slots is not None
    write_rows(full_pool(service), slots.tensor[:len(tokens)],
               expected_rows(tokens, full_pool(service).num_layers))
    service.insert(tokens, slots)


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + LIVENESS_S
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


@pytest.fixture
def frequent_switches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Threads switch every 20 us instead of every 5 ms (more interleavings per run), and
    the background thread's busy backoff stops at 20 ms (it passes often beside a busy
    scheduler). Both restored afterwards."""
    before = sys.getswitchinterval()
    monkeypatch.setattr("hicache.background_poller.BUSY_WAKE_S", 0.02)
    sys.setswitchinterval(2e-5)
    yield
    sys.setswitchinterval(before)


# ---- metrics readers ----------------------------------------------------------------------


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.status == 200
        return parse(response.read().decode("utf-8"))


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name{labels}``; ``KeyError`` when the scrape lacks it."""
    return samples[(name, frozenset(labels.items()))]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def check_scrape(samples: Samples, before: Samples | None) -> None:
    """What every scrape must show, on its own and against the one before it."""
    for direction in (D2H, H2D):
        submitted = total(samples, "hicache_transfer_ops_total", direction=direction)
        completed = value(samples, "hicache_transfer_completed_ops_total", direction=direction)
        in_flight = value(samples, "hicache_transfer_in_flight_ops", direction=direction)
        assert 0 <= completed <= submitted, (direction, completed, submitted)
        assert in_flight == submitted - completed, (direction, in_flight, submitted, completed)
    for (name, labels), v in samples.items():
        if name == "hicache_pool_used_tokens":
            capacity = samples[("hicache_pool_capacity_tokens", labels)]
            assert 0 <= v <= capacity, (labels, v, capacity)
    hits = total(samples, "hicache_hit_tokens_total")
    assert hits <= value(samples, "hicache_lookup_tokens_total")
    assert value(samples, "hicache_background_errors_total") == 0
    if before is not None:  # counters never go back
        for key, v in samples.items():
            if key[0].endswith("_total") and key in before:
                assert v >= before[key], (key, before[key], v)


class Readers:
    """Threads that read the service's counters while its scheduler runs: one scrapes the
    HTTP endpoint, one reads the plain counters with no lock (as a dashboard or benchmark
    may) and renders the exporter directly. Each checks what it reads as it goes; the first
    failure ends its thread and is kept in ``errors``."""

    def __init__(self, service: HiCacheService) -> None:
        self.service = service
        self.port = service.exporter.port if service.exporter is not None else None
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.scrapes = 0
        self.reads = 0
        self.threads = [threading.Thread(target=self._guard, args=(self._scrape_loop,)),
                        threading.Thread(target=self._guard, args=(self._read_loop,))]

    def __enter__(self) -> Readers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join()

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:
            self.errors.append(exc)

    def _scrape_loop(self) -> None:
        if self.port is None:
            return
        before: Samples | None = None
        while not self.stop_event.is_set():
            samples = scrape(self.port)
            check_scrape(samples, before)
            before = samples
            self.scrapes += 1
            time.sleep(0.001)

    def _read_loop(self) -> None:
        service = self.service
        transfers = service.controller.stats
        cache = service.tree.stats
        last: dict[str, int] = {}
        rendered: Samples | None = None
        while not self.stop_event.is_set():
            # acknowledged first: every ack it folds belongs to an op already submitted
            acknowledged = sum(transfers.ops_acknowledged.values())
            submitted = sum(transfers.ops_submitted.values())
            assert acknowledged <= submitted, (acknowledged, submitted)
            now = {
                "acknowledged": acknowledged, "submitted": submitted,
                "tokens": sum(dict(transfers.tokens).values()),
                "bytes": sum(dict(transfers.bytes).values()),
                "matched": cache.matched_tokens, "inserted": cache.inserted_tokens,
                "backed_up": cache.backed_up_tokens, "loaded": cache.loaded_back_tokens,
                "evicted_host": cache.evicted_host_tokens,
                "passes": service.stats.background_passes, "polls": service.stats.polls,
                "acks_applied": service.stats.acks_applied,
                "checks": service.stats.integrity_checks,
            }
            for name, v in now.items():
                assert v >= last.get(name, 0), (name, last.get(name), v)
            last = now
            assert service.stats.background_errors == 0
            assert service.engine_held_tokens >= 0
            if self.reads % 16 == 0 and service.exporter is not None:
                samples = parse(service.exporter.render().decode("utf-8"))
                check_scrape(samples, rendered)
                rendered = samples
            self.reads += 1
            time.sleep(0.0005)


# ---- the scheduler ------------------------------------------------------------------------


class Scheduler:
    """Random engine traffic, on one thread, with every count the service should end with.

    Under ``write_through_selective`` a match may queue a backup itself; a request then
    locks only the device prefix and loads nothing back. Neither a request nor an explicit
    integrity check steps first: the background thread may issue queued backups between
    any two calls (:func:`test_a_match_outlives_a_background_pass_before_its_lock`,
    :func:`test_check_integrity_beside_a_background_backup_pass`).
    """

    def __init__(self, service: HiCacheService, seed: int, vocab: int = 3,
                 max_len: int = 12, threaded: bool = True) -> None:
        self.service = service
        self.threaded = threaded  # a background thread runs (``quiet`` waits for its poll)
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.max_len = max_len
        self.locked: list[TreeNode] = []
        self.selective = service.tree.backup_hits is not None
        self.expected = Counter[str]()
        self.explicit_checks = 0
        self.quiet_waits = 0

    def tokens(self) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randrange(1, self.max_len))]

    def _match(self, tokens: list[int]) -> Any:
        match = self.service.match(tokens)
        self.expected["matched"] += len(tokens) // PAGE * PAGE
        self.expected["device_hits"] += match.device_hit_tokens
        self.expected["host_hits"] += match.host_hit_tokens
        return match

    def request(self) -> None:
        service, tokens = self.service, self.tokens()
        key = service.key(tokens)
        match = self._match(tokens)
        node = match.last_device_node if self.selective else match.last_host_node
        service.lock(node)
        prefix = match.device_indices
        assert rows_ok(service, tokens, prefix), "a matched device row changed"
        if match.host_hit_tokens and not self.selective:
            loaded = service.load_back(match, self.rng.choice([4, 64]))
            if loaded.queued:
                self.expected["loaded"] += loaded.num_tokens
                prefix = cat(prefix, loaded.device_indices)
        own = service.alloc_device(len(tokens) - len(prefix))
        service.start_loading()  # the batch starts (a queued load is never left unstarted)
        for layer in range(service.controller.num_layers):
            service.wait_until(layer)
        assert rows_ok(service, tokens, prefix), "a loaded row is wrong"
        if own is None:
            service.release(node)
            return
        write_rows(full_pool(service), own.tensor[:len(tokens) - len(prefix)],
                   expected_rows(tokens, full_pool(service).num_layers)[len(prefix):])
        slots = cat(prefix, own)
        cached = service.insert(key, slots)
        self.expected["inserted"] += key.num_page_tokens - cached
        whole = len(tokens) // PAGE * PAGE
        if len(slots) > whole:
            service.free_device(Indices(slots.tensor[whole:], IndexSpace.DEVICE_FULL))
        slots.tensor.add_(PAGE)  # the engine reuses its tensor: the service kept copies
        if self.rng.random() < 0.3:
            self.locked.append(node)  # a request still running
        else:
            service.release(node)

    def lookup(self) -> None:
        tokens = self.tokens()
        match = self._match(tokens)
        assert rows_ok(self.service, tokens, match.device_indices), "a matched row changed"

    def quiet(self) -> None:
        """A forward pass with no service call: the background thread polls what is in
        flight (or issues the queued backups), or, with nothing in flight, may run its idle
        check."""
        service = self.service
        if not self.threaded:
            return
        if service.controller.num_in_flight or service.tree.has_queued_backups:
            polls = service.stats.polls
            wait_for(lambda: service.stats.polls > polls, "a poll of the background thread")
            self.quiet_waits += 1
        else:
            time.sleep(0.003)

    def op(self) -> None:
        """One random operation."""
        service, rng = self.service, self.rng
        op = rng.random()
        if op < 0.40:
            self.request()
        elif op < 0.55:
            self.lookup()
        elif op < 0.65 and self.locked:
            service.release(self.locked.pop(rng.randrange(len(self.locked))))
        elif op < 0.72:
            service.evict(rng.randrange(1, 12))
        elif op < 0.76:
            service.evict_host(rng.randrange(1, 12))
        elif op < 0.86:
            service.step()
        elif op < 0.97:
            self.quiet()
        else:
            service.check_integrity()  # no step first: a backup may be queued
            self.explicit_checks += 1

    def release_all(self) -> None:
        for node in self.locked:
            self.service.release(node)
        self.locked.clear()

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            self.op()
        self.release_all()

    def empty(self) -> None:
        """Apply every ack and evict both tiers until nothing is cached (write-back needs
        rounds: a device eviction writes back first)."""
        service = self.service
        empty_everything(service)
        assert not list(service.tree.nodes()) and service.controller.num_in_flight == 0, \
            "the cache never emptied"


def run_in_thread(target: Callable[[], None]) -> None:
    """``target`` on a thread of its own (the engine's scheduler thread); its exception is
    raised here."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="scheduler")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def assert_drained(service: HiCacheService) -> None:
    """After ``stop``: every op submitted was acknowledged, and every ack applied once."""
    transfers = service.controller.stats
    submitted = sum(transfers.ops_submitted.values())
    assert submitted == sum(transfers.ops_acknowledged.values())
    assert submitted == service.stats.acks_applied
    assert service.controller.num_in_flight == 0 and not service.tree.has_queued_backups
    assert not any(node.is_in_flight for node in service.tree.nodes())


# ---- the stress tests ---------------------------------------------------------------------


@pytest.mark.parametrize("policy,hybrid,seed,num_ops", [
    ("write_through", False, 11, 1500),
    ("write_back", False, 12, 1500),
    ("write_through_selective", False, 13, 1500),
    ("write_through", True, 14, 1000),
])
@pytest.mark.usefixtures("frequent_switches")
def test_scheduler_beside_poller_checks_and_scrapes(policy: str, hybrid: bool, seed: int,
                                                    num_ops: int) -> None:
    """Random traffic on a scheduler thread under eviction pressure on both tiers, with the
    background thread polling, issuing backups and checking integrity every 2 ms of quiet,
    and two reader threads on the counters and the endpoint. Then: the tree is consistent,
    every counter the scheduler can predict is exact in the stats and in a scrape, every op
    submitted was acknowledged and applied once, the check counts add up, nothing leaked."""
    service = build_service(make_config(policy, hybrid=hybrid, host_ratio=2.0))
    service.start()
    try:
        scheduler = Scheduler(service, seed)
        with Readers(service) as readers:
            run_in_thread(lambda: scheduler.run(num_ops))
            # a quiet scheduler: the thread's idle check completes at least once
            completed = service.background_check.stats.completed
            wait_for(lambda: service.background_check.stats.completed > completed,
                     "an idle integrity check")
        assert not readers.errors, readers.errors
        assert readers.scrapes > 0 and readers.reads > 0
        for _ in range(10):  # apply what is in flight
            service.step()
        assert service.controller.num_in_flight == 0 and not service.tree.has_queued_backups
        service.check_integrity()
        scheduler.explicit_checks += 1

        cache, transfers = service.tree.stats, service.controller.stats
        expected = scheduler.expected
        assert cache.matched_tokens == expected["matched"]
        assert cache.device_hit_tokens == expected["device_hits"]
        assert cache.host_hit_tokens == expected["host_hits"]
        assert cache.inserted_tokens == expected["inserted"]
        assert cache.loaded_back_tokens == expected["loaded"]
        if not hybrid:  # every full-pool token moved is a node's backup or load, once
            assert transfers.tokens[(D2H, "full")] == cache.backed_up_tokens
            assert transfers.tokens[(H2D, "full")] == cache.loaded_back_tokens

        assert readers.port is not None
        samples = scrape(readers.port)
        check_scrape(samples, None)
        assert value(samples, "hicache_lookup_tokens_total") == expected["matched"]
        assert value(samples, "hicache_hit_tokens_total", tier="device") == expected["device_hits"]
        assert value(samples, "hicache_hit_tokens_total", tier="host") == expected["host_hits"]
        assert value(samples, "hicache_inserted_tokens_total") == expected["inserted"]
        assert value(samples, "hicache_load_back_tokens_total") == expected["loaded"]
        assert value(samples, "hicache_backup_tokens_total") == cache.backed_up_tokens
        assert value(samples, "hicache_evicted_tokens_total", tier="host") == \
            cache.evicted_host_tokens
        for direction in (D2H, H2D):
            acked = transfers.ops_acknowledged[direction]
            assert total(samples, "hicache_transfer_ops_total", direction=direction) == acked
            assert value(samples, "hicache_transfer_completed_ops_total",
                         direction=direction) == acked
            assert total(samples, "hicache_transfer_tokens_total", direction=direction) == \
                sum(v for (d, _), v in transfers.tokens.items() if d == direction)

        run_in_thread(scheduler.empty)
        service.check_integrity()
        scheduler.explicit_checks += 1
        assert service.engine_held_tokens == 0
        for space, allocator in service.tree.io.allocators().items():
            assert allocator.num_free_tokens == allocator.capacity_tokens, f"{space} leaked"
    finally:
        service.stop()
    assert_drained(service)
    stats, check = service.stats, service.background_check.stats
    assert stats.background_errors == 0
    assert stats.background_passes > 0 and check.completed > 0
    assert stats.integrity_checks == scheduler.explicit_checks + check.completed
    assert stats.integrity_checks_abandoned == check.abandoned
    assert stats.polls >= scheduler.quiet_waits  # each quiet wait saw the thread poll
    assert service.exporter is not None and service.exporter.port is None  # endpoint closed
    service.check_integrity()  # also after stop


class _SliceBeforeLock:
    """Stands in for the service lock in the call gate: before a scheduler call takes the
    lock (after it counted itself) ``slices`` slices of the background check run, in the
    window a real background thread can land in between ``CallGate.call`` (which counts the
    call) and the ``with`` statement's acquire."""

    def __init__(self, lock: threading.Lock, step: Callable[[], bool], slices: int) -> None:
        self.lock, self.step, self.slices = lock, step, slices
        self.completed = 0

    def __enter__(self) -> bool:
        for _ in range(self.slices):
            self.completed += self.step()
        return self.lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__(*exc)


@pytest.mark.parametrize("policy,hybrid,seed", [
    ("write_through", False, 21), ("write_back", False, 22), ("write_through", True, 23),
])
def test_check_started_between_a_calls_count_and_its_lock(policy: str, hybrid: bool,
                                                          seed: int) -> None:
    """Deterministic interleaving of the sliced check with scheduler calls, single-threaded:
    one slice (walking one node) runs after each call counted itself and before it took the
    lock, and zero to two between calls. A check that starts in that window counts the call
    as seen, but has walked nothing yet, so it walks the tree as the call left it; one in
    progress gives up. No slice may raise (a false positive kills the background thread),
    and both outcomes happen."""
    service = build_service(make_config(policy, hybrid=hybrid, metrics=False))
    check = service.background_check
    check.slice_s = 0.0  # one node per slice: a check spans many calls
    rng = random.Random(seed)
    hooked = _SliceBeforeLock(service.service_lock, check.step, slices=1)
    service._gate.lock = hooked  # type: ignore[assignment]  # the gate hands it to calls
    try:
        scheduler = Scheduler(service, seed, threaded=False)
        for _ in range(600):
            scheduler.op()
            for _ in range(rng.randrange(0, 3)):  # slices between calls, as when idle
                hooked.completed += check.step()
        scheduler.release_all()
        while check.in_progress or hooked.completed == 0:
            hooked.completed += check.step()
        service.check_integrity()
    finally:
        service._gate.lock = service.service_lock
        service.stop()
    assert check.stats.completed == hooked.completed > 0
    assert check.stats.abandoned > 0  # calls did land between slices
    assert_drained(service)


def test_check_walking_between_a_calls_count_and_its_lock_gives_up() -> None:
    """The same window with two slices in it: the first starts a check, the second walks a
    node, then the call (an ``evict_host`` of the host-only node the walk has not reached)
    takes the lock and removes it. The call's count came before the check began, so the
    walk goes on to the removed node and finds an inconsistency that is not there; the full
    check, run in one hold of the lock to confirm it, finds none, so nothing is raised and
    the finding is counted as unconfirmed. (On CPython 3.11 with the GIL the window has no
    periodic switch point, so a live thread lands there only through a finalizer run by the
    GC or on a free-threaded build.)"""
    service = build_service(make_config("write_through", metrics=False, interval_s=3600.0))
    check = service.background_check
    check.slice_s = 0.0
    try:
        put(service, [1, 1])  # X: the root's first child
        service.step()
        assert service.evict(10**6) == 2  # X on the host only
        put(service, [2, 2])  # Y: the root's second child, walked first
        service.step()
        service._gate.lock = _SliceBeforeLock(  # type: ignore[assignment]
            service.service_lock, check.step, slices=2)
        assert service.evict_host(2) == 2  # X leaves the tree
        service._gate.lock = service.service_lock
        assert check.in_progress
        while check.in_progress:
            check.step()
        assert check.stats.unconfirmed == 1 and check.stats.completed == 0
        service.check_integrity()
    finally:
        service._gate.lock = service.service_lock
        service.stop()


@pytest.mark.usefixtures("frequent_switches")
def test_counter_folding_beside_readers_and_drains() -> None:
    """``TransferStats`` folds its acks when read: an appender (the thread holding the
    service lock) acknowledges thousands of ops while two threads read the counters and a
    third drains durations, as the exporter does. Every ack is counted exactly once, every
    duration drained exactly once, and no read sees more acks than ops submitted."""
    stats = TransferStats()
    num_acks = 20_000
    stop = threading.Event()
    errors: list[BaseException] = []
    drained: list[tuple[str, float]] = []

    def append() -> None:
        for i in range(num_acks):
            direction = Direction.DEVICE_TO_HOST if i % 3 else Direction.HOST_TO_DEVICE
            stats.ops_submitted[direction.value] += 1
            stats.on_ack(Ack(i, direction, [], {"full": 2}, {"full": 96}, float(i), "torch"))

    def read() -> None:
        try:
            last = 0
            while not stop.is_set():
                acknowledged = sum(stats.ops_acknowledged.values())
                assert acknowledged <= sum(stats.ops_submitted.values())
                assert acknowledged >= last
                last = acknowledged
                assert sum(dict(stats.tokens).values()) <= 2 * num_acks
        except BaseException as exc:
            errors.append(exc)

    def drain() -> None:
        while not stop.is_set():
            drained.extend(stats.drain_durations())

    readers = [threading.Thread(target=read) for _ in range(2)] + [threading.Thread(target=drain)]
    for thread in readers:
        thread.start()
    append()
    stop.set()
    for thread in readers:
        thread.join()
    drained.extend(stats.drain_durations())
    assert not errors, errors
    assert stats.ops_acknowledged == Counter({D2H: num_acks - num_acks // 3 - 1,
                                              H2D: num_acks // 3 + 1})
    assert sum(stats.tokens.values()) == 2 * num_acks
    assert sum(stats.bytes.values()) == 96 * num_acks
    assert sorted(seconds for _, seconds in drained) == [float(i) for i in range(num_acks)]
    assert stats.in_flight_ops == 0 and not stats._unfolded


def test_in_flight_ops_read_beside_the_scheduler_is_never_negative() -> None:
    """A reader with no lock computes ``in_flight_ops`` while the scheduler submits and
    acknowledges an op: the thread switch is placed right after the reader summed
    ``ops_submitted`` (where CPython may switch: the next property call). Threaded, a
    lock-free reader of a live service's ``controller.stats.in_flight_ops`` saw -5 within
    3000 scheduler ops (default switch interval); beside a bare ``TransferStats`` fed as
    fast as possible (20 us interval), below -2000."""
    switched = []

    class SwitchAfterSum(Counter[str]):
        def values(self) -> Any:  # type: ignore[override]
            snapshot = list(super().values())
            if not switched:  # the scheduler thread runs here, once
                switched.append(True)
                self[D2H] += 1
                stats.on_ack(Ack(0, Direction.DEVICE_TO_HOST, [], {"full": 2}, {"full": 96},
                                 None, "torch"))
            return snapshot

    stats = TransferStats(_submitted=SwitchAfterSum())
    assert stats.in_flight_ops >= 0


# ---- stop, scrapes and failures ------------------------------------------------------------


class _Signalling:
    """The collector's source lock, setting ``entered`` when a scrape starts waiting for it."""

    def __init__(self, lock: threading.Lock, entered: threading.Event) -> None:
        self.lock, self.entered = lock, entered

    def __enter__(self) -> bool:
        self.entered.set()
        return self.lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__(*exc)


@pytest.mark.usefixtures("frequent_switches")
def test_stop_while_a_scrape_and_a_poll_wait_for_the_lock() -> None:
    """The service lock is held (a long scheduler call, or a slow scrape) while the
    background thread's first poll waits for it (four backups queued, no step), a scrape
    waits for it and ``stop()`` starts on another thread. Once the lock is free everything
    finishes, whoever gets it first: the scrape answers 200 with consistent counters, the
    poll and stop return, every backup is issued, acknowledged and applied once, the
    endpoint is closed; no deadlock."""
    service = build_service(make_config("write_through", interval_s=3600.0))
    for first in range(4):
        put(service, [first, first, 9, 9])  # backups queued, no step: the thread issues them
    polling, entered = threading.Event(), threading.Event()
    poll_once = service._poller._poll_once

    def signalling_poll_once() -> bool:
        polling.set()
        return poll_once()

    service._poller._poll_once = signalling_poll_once  # type: ignore[method-assign]
    exporter = service.exporter
    assert exporter is not None and exporter.collector.source_lock is service.service_lock
    exporter.collector.source_lock = _Signalling(service.service_lock, entered)
    scraped: list[Samples] = []
    outcome: list[BaseException | None] = []

    def stop() -> None:
        try:
            service.stop()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    stopper = threading.Thread(target=stop)
    try:
        with service.service_lock:
            service.start()  # takes no service lock; the thread's first pass polls
            port = exporter.port
            assert port is not None
            scraper = threading.Thread(target=lambda: scraped.append(scrape(port)))
            scraper.start()
            assert polling.wait(LIVENESS_S), "the background thread never polled"
            assert entered.wait(LIVENESS_S), "the scrape never reached the lock"
            stopper.start()
            time.sleep(0.05)  # lets stop() reach its join (nothing depends on it)
        stopper.join(LIVENESS_S)
        scraper.join(LIVENESS_S)
        assert not stopper.is_alive() and not scraper.is_alive(), "stop() or the scrape hung"
    finally:
        if not stopper.is_alive():
            service.stop()
    assert outcome == [None]
    assert len(scraped) == 1
    check_scrape(scraped[0], None)
    assert value(scraped[0], "hicache_inserted_tokens_total") == 16
    assert service.stats.polls >= 1 and service.stats.background_errors == 0
    assert_drained(service)
    assert service.tree.stats.backed_up_tokens == 16
    assert service.exporter is not None and service.exporter.port is None
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    service.check_integrity()


@pytest.mark.parametrize("surfaced", [True, False])
@pytest.mark.usefixtures("frequent_switches")
def test_background_failure_under_load_surfaces_once_and_stop_drains(surfaced: bool) -> None:
    """The background thread fails after traffic that ran beside the readers, with a backup
    queued: the failure is counted (and scraped) once, every later scheduler call raises it
    as ServiceError with the original as its cause, ``stop()`` raises it only if no call
    did, and still issues, drains and applies every op."""
    service = build_service(make_config("write_through", interval_s=0.002))
    service.start()
    boom = RuntimeError("injected background failure")

    def failing_poll_once() -> bool:
        raise boom

    scheduler = Scheduler(service, seed=31)
    try:
        with Readers(service) as readers:
            run_in_thread(lambda: scheduler.run(200))
        run_in_thread(service.step)  # nothing left queued for the thread before it fails
        assert not readers.errors, readers.errors
        port = readers.port
        assert port is not None
        service._poller._poll_once = failing_poll_once  # type: ignore[method-assign]
        put(service, [5, 5, 5, 5])  # a backup queued; the scheduler goes quiet
        wait_for(lambda: service.stats.background_errors == 1, "the injected failure")
        assert value(scrape(port), "hicache_background_errors_total") == 1
        if surfaced:
            for _ in range(2):
                with pytest.raises(ServiceError) as caught:
                    service.match([5, 5])
                assert caught.value.__cause__ is boom
    finally:
        if surfaced:
            service.stop()  # already raised by a call: not again
        else:
            with pytest.raises(ServiceError) as caught:
                service.stop()
            assert caught.value.__cause__ is boom
    assert service.stats.background_errors == 1
    assert service.tree.stats.backed_up_tokens >= 4  # the queued backup, issued by stop
    assert_drained(service)
    assert service.exporter is not None and service.exporter.port is None
    service.check_integrity()


# ---- an explicit check beside the background thread ----------------------------------------


class _PassAfterRunsRead:
    """Stands in for an allocator's free-run index: right after the index is read, the
    background thread's pass runs (issuing the queued backups: host slots allocated), if
    the service lock is free, as it is for a real thread."""

    def __init__(self, runs: Any, lock: threading.Lock, background_pass: Callable[[], Any]
                 ) -> None:
        self.runs, self.lock, self.background_pass = runs, lock, background_pass
        self.passes = 0

    def as_arrays(self) -> Any:
        arrays = self.runs.as_arrays()
        if not self.lock.locked() and not self.passes:
            self.passes += 1
            self.background_pass()
        return arrays

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runs, name)


def test_check_integrity_beside_a_background_backup_pass() -> None:
    """A scheduler inserts (write-through: a backup queued) and checks integrity before its
    next step, while the background thread's pass may issue the backup whenever the lock is
    free. The part of the check that runs outside the lock reads no allocator (the hook
    would run the pass right after such a read), and the check passes before and after the
    pass. The threaded stress test above checks without stepping first as well."""
    service = build_service(make_config("write_through", metrics=False, interval_s=3600.0))
    host = service.controller.host_pool.allocator
    runs = host._runs
    hook = _PassAfterRunsRead(runs, service.service_lock, service._poller._poll_once)
    try:
        put(service, [1, 1, 2, 2])
        assert service.tree.has_queued_backups
        host._runs = hook  # type: ignore[assignment]
        service.check_integrity()
        assert hook.passes == 0  # no allocator is read outside the lock
        service._poller._poll_once()  # the pass itself: the backup issued
        assert not service.tree.has_queued_backups
        service.check_integrity()
    finally:
        host._runs = runs
        service.stop()


# ---- a match held across a background pass -----------------------------------------------


def _host_only_and_a_queued_backup(service: HiCacheService) -> tuple[Any, Any]:
    """A = [1]*8 cached on the host only, filling it; B = [2]*8 on the device. Returns the
    match of A (a host hit) and then the match of B, which (its second hit, under
    ``write_through_selective``, the default policy) queues B's backup. The host has room
    for one of them: issuing B's backup evicts A, the only host-only leaf."""
    put(service, [1] * 8)
    service.match([1] * 8)
    service.match([1] * 8)  # the second hit: its backup is queued
    service.step()
    service.step()
    assert service.evict(10**6) == 8  # A now lives on the host only
    put(service, [2] * 8)
    service.match([2] * 8)
    service.step()
    match_a = service.match([1] * 8)
    assert match_a.host_hit_tokens == 8 and not service.tree.has_queued_backups
    match_b = service.match([2] * 8)
    assert service.tree.has_queued_backups  # the match queued B's backup
    return match_a, match_b


def _lock_both_and_load_a(service: HiCacheService, match_a: Any, match_b: Any) -> None:
    """The scheduler's calls after deciding to admit both: lock both matches (the lock of A
    fails if A left the tree), load A's host run back, release both."""
    service.lock(match_b.last_host_node)
    service.lock(match_a.last_host_node)
    assert service.load_back(match_a, 64).queued
    service.start_loading()
    service.release(match_a.last_host_node)
    service.release(match_b.last_host_node)


def _selective_small_host() -> HiCacheConfig:
    return make_config("write_through_selective", interval_s=3600.0, metrics=False,
                       device_tokens=16, host_ratio=0.5)


def test_a_match_outlives_the_scheduler_own_calls_until_its_lock() -> None:
    """The control for the next test, single-threaded: with no background thread, a
    scheduler that matches two requests and locks them after deciding what to admit (no
    step in between) keeps both matches valid, host run included, and loads it back."""
    service = build_service(_selective_small_host())
    try:
        _lock_both_and_load_a(service, *_host_only_and_a_queued_backup(service))
    finally:
        service.stop()
    assert_drained(service)


def test_a_match_outlives_a_background_pass_before_its_lock() -> None:
    """The same calls as the control, with the background thread running: between the
    matches and their locks the scheduler is quiet for one pass of the thread (it decides
    what to admit, or is descheduled), and the thread issues B's backup itself."""
    service = build_service(_selective_small_host())
    service.start()
    try:
        match_a, match_b = _host_only_and_a_queued_backup(service)
        polls = service.stats.polls
        wait_for(lambda: service.stats.polls > polls, "a poll of the background thread")
        _lock_both_and_load_a(service, match_a, match_b)  # A is still there: not evicted
    finally:
        service.stop()
