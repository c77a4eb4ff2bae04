"""Stress of the shared-store tier (L3) inside live services, under the threading contract:
each service (an "engine process") has one scheduler thread making every call, beside its
background thread (polling, issuing the backups a quiet scheduler left, checking integrity
every few ms), its two storage workers and a reader of its counters; two services share one
file store or one Redis server, each writing and prefetching the same prefixes.

Every assertion is exact, none about time (waits have a deadline only so that a hang fails):
every row a request reads, and every complete host copy in the tree (those from the store
included), holds the rows of its tokens, bit for bit; every prefetch and every put the
schedulers issued ends in exactly one counted outcome; counters never go back; slot
conservation holds before and after every pool is emptied; ``stop`` joins every thread the
services started. The prefetch races (a prefetch beside evictions, stop, a second finish, a
device insert of the same prefix, an overlapping prefetch) are placed deterministically.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import torch
from radix_helpers import expected_rows, read_rows, write_rows
from storage_helpers import needs_redis
from test_concurrency_stress import assert_drained, cat, frequent_switches, parse  # noqa: F401
from test_l3_tier import PAGE, make_config
from test_service import empty_everything
from test_service_refusals import refused

from hicache.bench.redis_local import RedisServer
from hicache.config import HiCacheConfig
from hicache.config.storage import StorageKind
from hicache.factory import build_service
from hicache.l3 import Prefetch, StorageTier
from hicache.pools import DeviceKVPool, HybridSWAPool, IndexSpace, Indices
from hicache.radix import TreeNode
from hicache.service import HiCacheService

LIVENESS_S = 60.0  # a deadline for waits on other threads: only a hang reaches it
WINDOW = 3  # test_l3_tier's hybrid model: a sliding window of 3 tokens


# ---- services ------------------------------------------------------------------------------


def l3_config(path: Path, *, url: str | None = None, policy: str = "write_through",
              prefetch: str = "wait_complete", hybrid: bool = False, device_tokens: int = 24,
              timeout_s: float = 2.0, interval_s: float = 0.002) -> HiCacheConfig:
    """test_l3_tier's model (pages of 2) on a file store at ``path`` or the Redis at ``url``;
    the background check every 2 ms of quiet, metrics rendered (no endpoint)."""
    config = make_config(path, policy=policy, prefetch=prefetch, hybrid=hybrid,
                         device_tokens=device_tokens, timeout_s=timeout_s)
    if url is not None:
        config = dataclasses.replace(config, storage=dataclasses.replace(
            config.storage, backend=StorageKind.REDIS, path=None, url=url))
    service = dataclasses.replace(config.service, metrics_enabled=True, metrics_port=0,
                                  integrity_check_interval_s=interval_s)
    return dataclasses.replace(config, service=service)


def build(config: HiCacheConfig, revision: str) -> HiCacheService:
    """A service naming its pages with ``revision`` (one per test: tests share no pages)."""
    return build_service(config, model_id="test/stress", model_revision=revision)


def tier_of(service: HiCacheService) -> StorageTier:
    assert service.storage is not None
    return service.storage


def url_of(server: RedisServer) -> str:
    return "redis://{}:{}".format(*server.address)


def full_pool(service: HiCacheService) -> DeviceKVPool:
    pool = service.device_pool
    return pool.full if isinstance(pool, HybridSWAPool) else pool


def write_tokens(service: HiCacheService, tokens: list[int], slots: Indices, start: int) -> None:
    """The engine's forward: rows of ``tokens[start:]`` at ``slots`` (full rows; SWA rows,
    offset by 0.5, where a hybrid pool gave a slot an SWA slot)."""
    pool, n = service.device_pool, len(tokens) - start
    layers = full_pool(service).num_layers
    write_rows(full_pool(service), slots.tensor[:n], expected_rows(tokens, layers)[start:])
    if isinstance(pool, HybridSWAPool):
        swa = pool.swa_slots_of(slots).tensor[:n]
        has = swa != 0
        write_rows(pool.swa, swa[has], expected_rows(tokens, 1, offset=0.5)[start:][has])


def rows_ok(service: HiCacheService, tokens: list[int], slots: Indices) -> bool:
    pool = full_pool(service)
    expected = expected_rows(tokens[:len(slots)], pool.num_layers)
    return torch.equal(read_rows(pool, slots.tensor), expected)


def put(service: HiCacheService, tokens: list[int]) -> None:
    """Allocate, write every row, insert (the backup is issued by the next step)."""
    slots = service.alloc_device(len(tokens))
    assert slots is not None
    write_tokens(service, tokens, slots, 0)
    service.insert(tokens, slots)


def path_tokens(service: HiCacheService, node: TreeNode) -> list[int]:
    tokens: list[int] = []
    while node is not service.tree.root:
        assert node.parent is not None
        tokens[:0] = node.tokens
        node = node.parent
    return tokens


def audit(service: HiCacheService) -> int:
    """Under the service lock: every complete host copy (its full rows, and its SWA rows for
    a hybrid model) and every device copy not being loaded holds the rows of its tokens;
    returns the nodes checked. Pages from the store are checked like any other."""
    controller, checked = service.controller, 0
    host_swa = getattr(controller, "host_swa", None)
    layers = full_pool(service).num_layers
    with service.service_lock:
        for node in service.tree.nodes():
            tokens = path_tokens(service, node)
            start = len(tokens) - node.num_tokens
            if node.is_backed_up:
                assert node.host is not None
                same = torch.equal(controller.host_pool.read_rows(node.host),
                                   expected_rows(tokens, layers)[start:])
                assert same, f"the host rows of {node!r} are not those of its tokens"
            if node.is_backed_up and host_swa is not None and node.host_swa is not None:
                slots = node.host_swa.tensor
                has = slots != 0
                rows = host_swa.read_rows(Indices(slots[has], IndexSpace.HOST_SWA))
                same = torch.equal(rows, expected_rows(tokens, 1, offset=0.5)[start:][has])
                assert same, f"the host SWA rows of {node!r} are not those of its tokens"
            if node.device is not None and node.load_op is None:
                same = torch.equal(read_rows(full_pool(service), node.device.tensor),
                                   expected_rows(tokens, layers)[start:])
                assert same, f"the device rows of {node!r} are not those of its tokens"
            checked += 1
    return checked


def busy(service: HiCacheService) -> bool:
    """Anything of the store or the host tier still in flight (read under the lock)."""
    tier = tier_of(service)
    with service.service_lock:
        return bool(any(n.store_op is not None or n.write_op is not None
                        for n in service.tree.nodes())
                    or tier.prefetches.held_slots() or tier.backups.held_slots()
                    or tier.prefetches.open_prefetches() or any(tier.queue_depths.values())
                    or service.controller.num_in_flight or service.tree.has_queued_backups)


def quiesce(service: HiCacheService) -> None:
    """Step until every backup, put and prefetch slot is settled."""
    deadline = time.monotonic() + LIVENESS_S
    while True:
        service.step()
        if not busy(service):
            return
        assert time.monotonic() < deadline, "the tier never settled"
        time.sleep(0.002)


def prompts(rng: random.Random, num: int = 24) -> list[list[int]]:
    """Shared system prompts (whole and partial pages) with branching continuations."""
    roots = [[1000 * r + i for i in range(rng.choice([4, 6, 8, 12]))] for r in range(4)]
    return [rng.choice(roots) + [rng.randrange(50, 60) for _ in range(rng.choice([1, 3, 6, 9]))]
            for _ in range(num)]


def new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive()]


# ---- the scheduler of one service ------------------------------------------------------------


class L3Scheduler:
    """Random engine traffic through one service (its only caller), with the counts its tier
    must end with. ``counts``: prefetches started and tokens asked, tokens attached, pages
    sent to the store and pages arrived (the tier's observer sees both)."""

    def __init__(self, service: HiCacheService, seed: int, requests: list[list[int]],
                 prefetch_rate: float = 0.6) -> None:
        self.service = service
        self.rng = random.Random(seed)
        self.requests = requests
        self.prefetch_rate = prefetch_rate
        self.pending: list[Prefetch] = []
        self.locked: list[TreeNode] = []
        self.counts = Counter[str]()
        self.ops_done = 0
        tier_of(service).observers.append(self._observe)

    def _observe(self, event: str, hashes: list[bytes], host: torch.Tensor,
                 swa: torch.Tensor | None) -> None:
        # called under the service lock (the scheduler, or the background thread's backups)
        self.counts[f"{event}_pages"] += len(hashes)
        self.counts[f"{event}_calls"] += 1

    def finish(self, prefetch: Prefetch, *, may_wait: bool = True) -> bool:
        """Finish ``prefetch`` when the policy says so (waiting on it, or asking), or at
        once; ``False`` when it was left for a later round."""
        service, mode = self.service, self.rng.random()
        if mode < 0.4:
            service.wait_prefetch(prefetch, timeout_s=self.rng.choice([0.0, 0.005, LIVENESS_S]))
        elif mode < 0.8 and not service.prefetch_ready(prefetch) and may_wait \
                and len(self.pending) < 4:
            self.pending.append(prefetch)
            return False
        self.counts["attached"] += service.finish_prefetch(prefetch)
        self.counts["finished"] += 1
        return True

    def request(self) -> None:
        service, rng = self.service, self.rng
        tokens = rng.choice(self.requests)
        key = service.key(tokens)
        match = service.match(key)
        prefetch = service.prefetch(key, match) if rng.random() < self.prefetch_rate else None
        if prefetch is not None:
            self.counts["prefetches"] += 1
            self.counts["queried"] += prefetch.num_tokens
            if len(self.pending) < 4 and rng.random() < 0.3:
                self.pending.append(prefetch)  # the request is scheduled in a later round
                return
            if not self.finish(prefetch):
                return  # not ready: the same
            match = service.match(key)
        node = match.last_host_node
        service.lock(node)
        prefix = match.device_indices
        if match.host_hit_tokens:
            loaded = service.load_back(match, rng.choice([4, 64, 64]))
            if loaded.queued:
                prefix = cat(prefix, loaded.device_indices)
        own = service.alloc_device(len(tokens) - len(prefix))
        service.start_loading()
        for layer in range(service.controller.num_layers):
            service.wait_until(layer)
        assert rows_ok(service, tokens, prefix), "a matched or loaded row is wrong"
        if own is None:
            service.release(node)
            return
        write_tokens(service, tokens, own, len(prefix))
        if isinstance(service.device_pool, HybridSWAPool) and rng.random() < 0.5:
            # own pages that left every later token's window give their SWA slots back
            # (their SWA rows go to the host first)
            keep_from = len(tokens) // PAGE * PAGE - WINDOW + 1
            done = max(0, min(len(own) // PAGE, (keep_from - len(prefix)) // PAGE))
            if done:
                service.release_window(Indices(own.tensor[:done * PAGE], IndexSpace.DEVICE_FULL))
        slots = cat(prefix, own)
        service.insert(key, slots)
        whole = len(tokens) // PAGE * PAGE
        if len(slots) > whole:
            service.free_device(Indices(slots.tensor[whole:], IndexSpace.DEVICE_FULL))
        if rng.random() < 0.2:
            self.locked.append(node)  # a request still running
        else:
            service.release(node)

    def op(self) -> None:
        service, rng = self.service, self.rng
        op = rng.random()
        if op < 0.45:
            self.request()
        elif op < 0.55 and self.pending:
            self.finish(self.pending.pop(rng.randrange(len(self.pending))), may_wait=False)
        elif op < 0.62 and self.locked:
            service.release(self.locked.pop(rng.randrange(len(self.locked))))
        elif op < 0.70:
            service.evict(rng.randrange(1, 16))
        elif op < 0.76:
            service.evict_host(rng.randrange(1, 24))
        elif op < 0.86:
            service.step()
        elif op < 0.95:
            time.sleep(0.002)  # a forward with no call: the other threads run
        elif op < 0.98:
            service.check_integrity()  # no step first
        else:
            assert audit(service) >= 0

    def run(self, num_ops: int) -> None:
        for _ in range(num_ops):
            self.op()
            self.ops_done += 1
        self.wind_down()

    def wind_down(self) -> None:
        """Finish every open prefetch, release every lock, let the tier settle."""
        while self.pending:
            self.finish(self.pending.pop(), may_wait=False)
        for node in self.locked:
            self.service.release(node)
        self.pending.clear()
        self.locked.clear()
        quiesce(self.service)


class CounterReader:
    """A thread reading the services' tier counters with no lock (the plain stats) and
    through a metrics render, while the schedulers run: every counter only ever grows.
    The first failure ends the thread and is kept in ``errors``."""

    def __init__(self, services: list[HiCacheService]) -> None:
        self.services = services
        self.errors: list[BaseException] = []
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="l3-reader")

    def __enter__(self) -> CounterReader:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last: dict[tuple[int, str], float] = {}
        try:
            while not self._stop.is_set():
                for i, service in enumerate(self.services):
                    for name, v in self._read(service).items():
                        assert v >= last.get((i, name), 0), (i, name, last.get((i, name)), v)
                        last[(i, name)] = v
                self.reads += 1
                time.sleep(0.001)
        except BaseException as exc:
            self.errors.append(exc)

    def _read(self, service: HiCacheService) -> dict[str, float]:
        stats = tier_of(service).stats
        now: dict[str, float] = {name: getattr(stats, name) for name in (
            "prefetches", "queried_tokens", "found_tokens", "backup_evictions",
            "worker_errors")}
        now |= {f"prefetch:{k}": v for k, v in dict(stats.prefetch_tokens).items()}
        now |= {f"backup:{k}": v for k, v in dict(stats.backup_pages).items()}
        if self.reads % 8 == 0 and service.exporter is not None:
            samples = parse(service.exporter.render().decode("utf-8"))
            now |= {f"{name}{sorted(labels)}": v for (name, labels), v in samples.items()
                    if name.startswith("hicache_l3_") and name.endswith("_total")}
        return now


def check_accounts(scheduler: L3Scheduler, *, faults: bool = False) -> None:
    """After ``quiesce``: every prefetch and every put the scheduler issued ended in exactly
    one outcome, and what the tier counted is what the scheduler saw."""
    stats, counts = tier_of(scheduler.service).stats, scheduler.counts
    outcomes, backups = stats.prefetch_tokens, stats.backup_pages
    assert stats.prefetches == counts["prefetches"] == counts["finished"]
    assert stats.queried_tokens == counts["queried"]
    assert outcomes["queue_full"] == 0  # 256 queued queries at most: never here
    assert sum(outcomes.values()) == stats.queried_tokens, dict(outcomes)
    assert outcomes["used"] == counts["attached"]
    assert outcomes["used"] + outcomes["cached"] == counts["arrive_pages"] * PAGE
    assert stats.found_tokens <= stats.queried_tokens
    assert backups["stored"] + backups["failed"] == counts["put_pages"], dict(backups)
    assert backups["dropped"] == 0
    if not faults:
        assert backups["failed"] == 0 and stats.worker_errors == 0
        assert not {"corrupt", "error"} & {k for k, v in outcomes.items() if v}


def check_store_calls(scheduler: L3Scheduler, tier: StorageTier, *, faults: bool = False,
                      raised: Mapping[str, int] | None = None) -> None:
    """After ``stop`` (the workers joined): one store query per prefetch, one put per put
    job (``raised``: calls of each op that raised instead), every page stored written or
    found there already."""
    store, raised = tier.store.stats(), raised or {}
    assert store.exists_calls + raised.get("exists", 0) == tier.stats.prefetches
    assert store.put_calls + raised.get("put", 0) == scheduler.counts["put_calls"]
    if not faults:
        assert tier.stats.backup_pages["stored"] == store.pages_written + store.pages_skipped


def empty_and_check(service: HiCacheService) -> None:
    service.check_integrity()
    empty_everything(service)
    service.check_integrity()
    assert not list(service.tree.nodes()) and service.engine_held_tokens == 0
    for space, allocator in service.tree.io.allocators().items():
        assert allocator.num_free_tokens == allocator.capacity_tokens, f"{space} leaked"


def run_schedulers(schedulers: list[L3Scheduler], num_ops: int,
                   beside: Callable[[], None] | None = None) -> None:
    """Each scheduler on a thread of its own (two engine processes), ``beside`` on this one;
    the first exception of any is raised here."""
    errors: list[BaseException] = []

    def guard(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(lambda s=s: s.run(num_ops),),
                                name=f"scheduler-{i}") for i, s in enumerate(schedulers)]
    for thread in threads:
        thread.start()
    if beside is not None:
        guard(beside)
    for thread in threads:
        thread.join(LIVENESS_S * 4)
        assert not thread.is_alive(), "a scheduler hung"
    if errors:
        raise errors[0]


# ---- two engines sharing a store -------------------------------------------------------------


@pytest.mark.parametrize("backend,policy,prefetch,hybrid,seed", [
    ("file", "write_through", "wait_complete", False, 1),
    ("file", "write_back", "best_effort", False, 2),
    ("file", "write_through_selective", "timeout", False, 3),
    ("file", "write_through", "wait_complete", True, 4),
    pytest.param("redis", "write_through", "best_effort", False, 5, marks=needs_redis),
    pytest.param("redis", "write_back", "wait_complete", True, 6, marks=needs_redis),
])
@pytest.mark.usefixtures("frequent_switches")
def test_two_engines_share_a_store_under_random_traffic(
        tmp_path: Path, backend: str, policy: str, prefetch: str, hybrid: bool, seed: int
) -> None:
    """Two services, each driven by its own scheduler thread beside its background thread,
    storage workers and a counter reader, write and prefetch the same prefixes through one
    store: every row read and every host copy is right, every prefetch and put is counted
    once, nothing leaks, and stop joins every thread."""
    threads_before = set(threading.enumerate())
    server = RedisServer(tmp_path / "redis").start() if backend == "redis" else None
    try:
        url = None if server is None else url_of(server)
        config = l3_config(tmp_path / "l3", url=url, policy=policy, prefetch=prefetch,
                           hybrid=hybrid)
        services = [build(config, tmp_path.name), build(config, tmp_path.name)]
        rng = random.Random(seed)
        requests = prompts(rng)
        schedulers = [L3Scheduler(s, seed * 10 + i, requests) for i, s in enumerate(services)]
        try:
            for service in services:
                service.start()
            with CounterReader(services) as reader:
                run_schedulers(schedulers, 400)
            assert not reader.errors, reader.errors
            assert reader.reads > 0
            for scheduler in schedulers:
                check_accounts(scheduler)
                assert audit(scheduler.service) > 0
            assert sum(tier_of(s).stats.prefetch_tokens["used"] for s in services) > 0, \
                "no page ever came from the store"
            tiers = [tier_of(s) for s in services]
            for service in services:
                empty_and_check(service)
        finally:
            for service in services:
                service.stop()
        for scheduler, tier in zip(schedulers, tiers, strict=True):
            check_store_calls(scheduler, tier)
            assert_drained(scheduler.service)
            scheduler.service.check_integrity()
            assert scheduler.service.stats.background_errors == 0
    finally:
        if server is not None:
            server.stop()
    assert new_threads(threads_before) == []


# ---- prefetch races, placed deterministically ------------------------------------------------


TOKENS = list(range(300, 324))  # 12 pages


@pytest.fixture
def writer_and_reader(tmp_path: Path) -> Iterator[tuple[HiCacheService, HiCacheService]]:
    """Two services on one file store; the first has stored ``TOKENS``."""
    config = l3_config(tmp_path / "l3", interval_s=60.0)
    a, b = build(config, tmp_path.name), build(config, tmp_path.name)
    try:
        put(a, TOKENS)
        quiesce(a)
        assert tier_of(a).stats.backup_pages["stored"] == len(TOKENS) // PAGE
        yield a, b
    finally:
        a.stop()
        b.stop()


def wait_answered(prefetch: Prefetch) -> None:
    """Until the store answered the query (read without any service call, so the scheduler
    has not applied the answer)."""
    deadline = time.monotonic() + LIVENESS_S
    while prefetch.found_tokens is None:
        assert time.monotonic() < deadline, "the store never answered"
        time.sleep(0.001)


def start(service: HiCacheService, tokens: list[int]) -> Prefetch:
    key = service.key(tokens)
    prefetch = service.prefetch(key, service.match(key))
    assert prefetch is not None
    return prefetch


def outcomes(service: HiCacheService) -> dict[str, int]:
    return {k: v for k, v in tier_of(service).stats.prefetch_tokens.items() if v}


def test_a_second_finish_and_later_calls_are_refused_with_nothing_changed(
        writer_and_reader: tuple[HiCacheService, HiCacheService]) -> None:
    """finish_prefetch twice: the second, and prefetch_ready and wait_prefetch after the
    first, are refused and change nothing (slots, locks, counters)."""
    _, b = writer_and_reader
    prefetch = start(b, TOKENS)
    assert b.wait_prefetch(prefetch, timeout_s=LIVENESS_S)
    assert b.finish_prefetch(prefetch) == len(TOKENS)
    before = outcomes(b)
    for call in (b.finish_prefetch, b.prefetch_ready, b.wait_prefetch):
        refused(b, ValueError, "finished already", call, prefetch)
    assert outcomes(b) == before == {"used": len(TOKENS)}
    assert audit(b) > 0
    empty_and_check(b)


def test_a_prefetch_survives_evictions_and_a_split_of_its_node(
        writer_and_reader: tuple[HiCacheService, HiCacheService]) -> None:
    """While a prefetch below a device prefix is open, everything is evicted from both
    tiers and the matched node is split by another insert: the matched node stays (locked),
    the pages arrive under it, bit for bit, and every slot comes back."""
    _, b = writer_and_reader
    put(b, TOKENS[:8])
    quiesce(b)
    prefetch = start(b, TOKENS)
    assert prefetch.num_tokens == len(TOKENS) - 8
    b.evict(10**6)
    b.step()
    b.evict_host(10**6)
    put(b, [*TOKENS[:4], 7, 7])  # splits the matched node after its 4th token
    assert b.wait_prefetch(prefetch, timeout_s=LIVENESS_S)
    assert b.finish_prefetch(prefetch) == len(TOKENS) - 8
    match = b.match(TOKENS)
    assert match.device_hit_tokens + match.host_hit_tokens == len(TOKENS)
    assert audit(b) > 0
    b.check_integrity()
    empty_and_check(b)


def test_a_prefix_computed_on_the_device_meanwhile_keeps_the_device_rows(
        writer_and_reader: tuple[HiCacheService, HiCacheService]) -> None:
    """The store answers a prefetch, then the engine computes the same prefix itself before
    the pages are read: every arrived page is counted ``cached``, none replaces the tree's,
    and the arrived slots are freed."""
    _, b = writer_and_reader
    prefetch = start(b, TOKENS)
    wait_answered(prefetch)
    put(b, TOKENS)
    assert b.wait_prefetch(prefetch, timeout_s=LIVENESS_S)
    assert b.finish_prefetch(prefetch) == 0
    assert outcomes(b) == {"cached": len(TOKENS)}
    assert audit(b) > 0
    empty_and_check(b)


@pytest.mark.parametrize("longer_first", [True, False])
def test_two_prefetches_of_overlapping_prefixes(
        writer_and_reader: tuple[HiCacheService, HiCacheService], longer_first: bool) -> None:
    """Two open prefetches from the root, of 8 and of 24 tokens: whichever finishes first
    attaches its pages, the other only what the tree lacks; the overlap counts ``cached``."""
    _, b = writer_and_reader
    short, long = start(b, TOKENS[:8]), start(b, TOKENS)
    for prefetch in (short, long):
        assert b.wait_prefetch(prefetch, timeout_s=LIVENESS_S)
    first, second = (long, short) if longer_first else (short, long)
    attached = [b.finish_prefetch(first), b.finish_prefetch(second)]
    assert attached == ([24, 0] if longer_first else [8, 16])
    assert outcomes(b) == {"used": 24, "cached": 8}
    assert audit(b) > 0
    empty_and_check(b)


@pytest.mark.parametrize("answered", [True, False])
def test_stop_finishes_an_open_prefetch_and_counts_it_cancelled(
        writer_and_reader: tuple[HiCacheService, HiCacheService], answered: bool) -> None:
    """stop() with a prefetch open (its query answered but not applied, or never asked
    for: the engine dropped the request's turn): the prefetch is finished, its lock gone,
    its slots back, and its pages not read count as ``cancelled`` (README: "cancelled: the
    service stopped")."""
    _, b = writer_and_reader
    tier = tier_of(b)
    prefetch = start(b, TOKENS)
    if answered:
        wait_answered(prefetch)
    b.stop()
    assert prefetch.finished
    assert not any(n.lock_count for n in b.tree.nodes())
    b.check_integrity()
    counts = {k: v for k, v in tier.stats.prefetch_tokens.items() if v}
    assert sum(counts.values()) == tier.stats.queried_tokens == len(TOKENS)
    used = counts.get("used", 0)  # none: nothing was read before the stop
    assert counts == {"cancelled": len(TOKENS) - used} | ({"used": used} if used else {}), counts
