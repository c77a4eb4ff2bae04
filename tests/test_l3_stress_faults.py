"""Faults under the shared-store tier (L3) while two engines run: a Redis server killed
(SIGKILL) and restarted on its port, or stopped (SIGSTOP) for longer than the store's deadline
and continued; the file store's directory removed, or replaced by a file, mid-run; page
files truncated and corrupted under the readers; a store whose calls raise. The schedulers,
background threads and storage workers of test_l3_stress run throughout.

What must hold, exactly: the cache keeps serving from the device and the host (every row read
is right, every host copy too), every prefetch and put ends in one counted outcome, no slot or
lock leaks, no prefetch waits forever, integrity holds, stop joins every thread; and once the
fault is gone the store is used again. Then, one test each, the faults' exact outcomes.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import shutil
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from storage_helpers import hashes, make_pool, namespace, needs_redis, views
from test_l3_stress import (  # noqa: F401 (frequent_switches: a fixture)
    LIVENESS_S,
    TOKENS,
    L3Scheduler,
    audit,
    build,
    check_accounts,
    check_store_calls,
    empty_and_check,
    frequent_switches,
    l3_config,
    new_threads,
    prompts,
    put,
    quiesce,
    run_schedulers,
    start,
    tier_of,
    url_of,
    write_tokens,
)

from hicache.bench.redis_local import RedisServer
from hicache.service import HiCacheService
from hicache.storage import FileStore, PageBuffers, PageStatus, StorageBackend, StorageResult

NUM_OPS = 240


class FailingFileStore(FileStore):
    """A file store whose data calls raise while ``failing`` is set. No real store raises
    (they return statuses), so this is the one fault made by a subclass."""

    failing = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.raised = Counter[str]()  # calls that raised, by op
        self._count_lock = threading.Lock()  # both storage workers call

    def _check(self, op: str) -> None:
        if self.failing:
            with self._count_lock:
                self.raised[op] += 1
            raise OSError("injected: the store is down")

    def exists(self, page_hashes: Sequence[bytes], timeout_s: float | None = None
               ) -> StorageResult:
        self._check("exists")
        return super().exists(page_hashes, timeout_s)

    def get(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        self._check("get")
        return super().get(page_hashes, pages, timeout_s)

    def put(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        self._check("put")
        return super().put(page_hashes, pages, timeout_s)


@pytest.fixture
def failing_stores(monkeypatch: pytest.MonkeyPatch) -> list[FailingFileStore]:
    """Every service built in the test gets a :class:`FailingFileStore` (listed here)."""
    made: list[FailingFileStore] = []

    def open_failing(config: Any, ns: Any) -> StorageBackend:
        made.append(FailingFileStore(config.storage.path, ns, timeout_s=config.storage.timeout_s))
        return made[-1]

    monkeypatch.setattr("hicache.factory.open_configured_store", open_failing)
    return made


def namespace_dir(root: Path) -> Path:
    (directory,) = [p for p in root.iterdir() if p.is_dir()]
    return directory


def damage_files(root: Path, rng: random.Random) -> int:
    """Truncate half of the page files and flip a payload byte of the others; how many."""
    files = sorted(root.rglob("*.kv"))
    for path in files:
        try:
            if rng.random() < 0.5:
                os.truncate(path, path.stat().st_size // 2)
            else:
                data = bytearray(path.read_bytes())
                data[-3] ^= 0x10
                path.write_bytes(bytes(data))
        except FileNotFoundError:
            continue  # deleted by a reader that found it corrupt
    return len(files)


def remove_at_once(directory: Path) -> None:
    """Remove ``directory`` with what it holds, in one step whatever is being written."""
    removed = directory.parent.parent / "removed"
    directory.rename(removed)
    shutil.rmtree(removed)


class Fault:
    """What to break and how to mend it, for one kind of fault."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.root = tmp_path / "l3"
        self.server = RedisServer(tmp_path / "redis").start() if kind in ("kill", "pause") \
            else None
        self.stores: list[FailingFileStore] = []
        self.rng = random.Random(7)
        self.damaged = 0

    @property
    def url(self) -> str | None:
        return None if self.server is None else url_of(self.server)

    def inject(self) -> None:
        if self.kind == "kill":
            assert self.server is not None
            self.server.kill()
        elif self.kind == "pause":
            assert self.server is not None
            self.server.pause()
        elif self.kind == "removed":
            remove_at_once(namespace_dir(self.root))
        elif self.kind == "unwritable":
            directory = namespace_dir(self.root)
            blocker = self.root.parent / "blocker"
            blocker.write_bytes(b"")
            while True:  # a file where the directory was: no write works
                remove_at_once(directory)
                try:
                    blocker.rename(directory)
                    break
                except IsADirectoryError:
                    continue  # a put made the directory again meanwhile
        elif self.kind == "corrupt":
            self.damaged += damage_files(self.root, self.rng)
        else:
            for store in self.stores:
                store.failing = True

    def heal(self) -> None:
        if self.kind == "kill":
            assert self.server is not None
            self.server.start()  # the same port
        elif self.kind == "pause":
            assert self.server is not None
            self.server.resume()
        elif self.kind == "unwritable":
            (directory,) = list(self.root.iterdir())
            directory.unlink()
            directory.mkdir(exist_ok=True)  # or the next put makes it
        elif self.kind == "corrupt":
            self.damaged += damage_files(self.root, self.rng)
        elif self.kind == "raising":
            for store in self.stores:
                store.failing = False

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def fault_felt(services: Sequence[HiCacheService]) -> int:
    """Store calls and backups of ``services`` that failed, timed out or read damage."""
    felt = 0
    for tier in (tier_of(s) for s in services):
        stats = tier.store.stats()
        felt += (tier.stats.backup_pages["failed"] + tier.stats.worker_errors
                 + stats.pages_error + stats.pages_timeout + stats.pages_corrupt)
    return felt


def wait_ops(schedulers: list[L3Scheduler], num_ops: int) -> None:
    deadline = time.monotonic() + LIVENESS_S
    while min(s.ops_done for s in schedulers) < num_ops:
        assert time.monotonic() < deadline, "the schedulers stalled"
        time.sleep(0.005)


def stored_again(writer: HiCacheService, reader: HiCacheService, first: int) -> None:
    """Once the fault is gone the store is used again: a new prefix ``writer`` backs up is
    fetched whole by ``reader`` (retried while a circuit waits out its backoff)."""
    deadline = time.monotonic() + LIVENESS_S
    for attempt in itertools.count():
        tokens = [first + 100 * attempt + i for i in range(8)]
        put(writer, tokens)
        for _ in range(2):  # the hits a selective backup waits for
            writer.match(tokens)
        quiesce(writer)
        writer.evict(10**6)  # a write-back goes to the store when its host copy leaves
        quiesce(writer)
        writer.evict_host(10**6)
        quiesce(writer)
        prefetch = start(reader, tokens)
        assert reader.wait_prefetch(prefetch, timeout_s=LIVENESS_S)
        if reader.finish_prefetch(prefetch) == len(tokens):
            return
        assert time.monotonic() < deadline, "the store was never used again"
        time.sleep(0.1)


# ---- traffic through faults ------------------------------------------------------------------


@pytest.mark.parametrize("kind,policy,seed", [
    pytest.param("kill", "write_through", 1, marks=needs_redis),
    pytest.param("pause", "write_back", 2, marks=needs_redis),
    ("removed", "write_through", 3),
    ("unwritable", "write_back", 4),
    ("corrupt", "write_through", 5),
    ("raising", "write_through_selective", 6),
])
@pytest.mark.usefixtures("frequent_switches")
def test_engines_keep_serving_through_a_store_fault(
        tmp_path: Path, request: pytest.FixtureRequest, kind: str, policy: str, seed: int
) -> None:
    """Two engines under random traffic while the store fails a third of the way in and is
    mended two thirds in: rows, host copies, outcome counts, slots, locks and threads as
    without a fault (the module docstring)."""
    threads_before = set(threading.enumerate())
    failing_stores: list[FailingFileStore] = \
        request.getfixturevalue("failing_stores") if kind == "raising" else []
    fault = Fault(kind, tmp_path)
    try:
        config = l3_config(tmp_path / "l3", url=fault.url, policy=policy, timeout_s=0.3)
        services = [build(config, tmp_path.name), build(config, tmp_path.name)]
        fault.stores = failing_stores
        requests = prompts(random.Random(seed))
        schedulers = [L3Scheduler(s, seed * 10 + i, requests) for i, s in enumerate(services)]

        def break_and_mend() -> None:
            wait_ops(schedulers, NUM_OPS // 3)
            fault.inject()
            broken = time.monotonic()
            wait_ops(schedulers, 2 * NUM_OPS // 3)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - broken)))  # > 3 store deadlines
            # On a loaded machine the storage workers may not have reached the store yet:
            # keep it broken until one of its calls felt the fault (or the liveness bound).
            until = time.monotonic() + LIVENESS_S
            while kind != "removed" and not fault_felt(services) and time.monotonic() < until:
                time.sleep(0.01)
            fault.heal()

        try:
            for service in services:
                service.start()
            run_schedulers(schedulers, NUM_OPS, beside=break_and_mend)
            for scheduler in schedulers:
                check_accounts(scheduler, faults=True)
                assert audit(scheduler.service) > 0
            errors = sum(tier_of(s).stats.worker_errors for s in services)
            assert errors == sum(sum(s.raised.values()) for s in failing_stores)  # a job each
            stored_again(services[0], services[1], 5000)
            tiers = [tier_of(s) for s in services]
            # a removed directory is made again by the next put: its pages are misses,
            # nothing fails (test_a_removed_store_directory_is_made_again)
            assert fault_felt(services) > 0 or kind == "removed", "the fault was never seen"
            for service in services:
                empty_and_check(service)
        finally:
            for service in services:
                service.stop()
        for i, (scheduler, tier) in enumerate(zip(schedulers, tiers, strict=True)):
            check_store_calls(scheduler, tier, faults=True,
                              raised=failing_stores[i].raised if failing_stores else None)
            scheduler.service.check_integrity()
            assert scheduler.service.stats.background_errors == 0
        if kind == "corrupt":
            corrupt = sum(t.stats.prefetch_tokens["corrupt"] for t in tiers)
            assert corrupt <= 2 * sum(t.store.stats().pages_corrupt for t in tiers)
    finally:
        fault.close()
    assert new_threads(threads_before) == []


# ---- each fault's exact outcome --------------------------------------------------------------


def backed_up(service: HiCacheService) -> None:
    """Step until every host backup is acknowledged (the store's puts may still wait)."""
    deadline = time.monotonic() + LIVENESS_S
    while True:
        service.step()
        if not service.controller.num_in_flight and \
                not any(n.write_op is not None for n in service.tree.nodes()):
            return
        assert time.monotonic() < deadline, "a backup never finished"
        time.sleep(0.002)


@needs_redis
def test_a_queued_put_sends_the_sliding_window_rows_of_its_own_tokens(
        tmp_path: Path, own_server: RedisServer) -> None:
    """A hybrid page goes to the store with its SWA rows, read from the node's host SWA
    slots when the put runs. Here X's put waits behind another (the server is stopped,
    within the store's deadline) while a backup short of SWA host room looks for SWA copies
    to free: X's stay until its put is back, as its full rows do (before, evict_host_swa
    passed over the put in flight and gave X's slots to Z's rows), so Z's backup is refused
    for room. Another engine that prefetches X must get X's SWA rows, not Z's."""
    config = l3_config(tmp_path / "l3", url=url_of(own_server), hybrid=True, device_tokens=16,
                       timeout_s=LIVENESS_S, interval_s=60.0)
    config = dataclasses.replace(config, host=dataclasses.replace(config.host, ratio=1.0))
    a, b = build(config, tmp_path.name), build(config, tmp_path.name)
    x, y, z, w = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33], list(range(40, 48))
    try:
        own_server.pause()
        put(a, y)
        backed_up(a)  # Y's put runs and waits for the server
        match_y = a.match(y)
        a.lock(match_y.last_device_node)  # a request still reading Y
        put(a, x)
        backed_up(a)  # X's put is queued behind Y's
        window = a.alloc_device(len(w))
        assert window is not None
        write_tokens(a, w, window, 0)
        a.release_window(window)  # a running request's window rows fill the SWA host pool
        backed_up(a)
        assert a.evict(len(x)) == len(x)  # X is now on the host only, its put still queued
        put(a, z)
        backed_up(a)  # Z's backup needs SWA host room: none is free while X's put waits
        assert a.tree.stats.evicted_host_swa_tokens == 0  # X's SWA copies stayed
        assert a.tree.stats.refused_backups == {"host_full": len(z)}
        own_server.resume()
        quiesce(a)
        assert tier_of(a).stats.backup_pages == {"stored": 4, "failed": 0, "no_swa_rows": 0}
        prefetch = start(b, x)
        assert b.wait_prefetch(prefetch, timeout_s=LIVENESS_S)
        assert b.finish_prefetch(prefetch) == len(x)
        audit(b)  # X's host SWA rows, from the store
        a.release(match_y.last_device_node)
        a.free_device(window)
    finally:
        own_server.resume()
        a.stop()
        b.stop()


@pytest.mark.parametrize("fault,outcome", [
    pytest.param("killed", "error", marks=needs_redis),
    pytest.param("paused", "timeout", marks=needs_redis),
    ("raising", "error"),
])
def test_a_prefetch_the_store_failed_is_counted_as_its_failure(
        tmp_path: Path, request: pytest.FixtureRequest, fault: str, outcome: str) -> None:
    """A prefetch whose query the store could not answer (a killed server: errors; a
    stopped one past the deadline: timeouts; a store that raises: an error) counts its
    tokens as ``error``/``timeout`` (README: "timeout: ... or the store's deadline passed";
    "error: ... or the store failed"), not as ``not_found``: a dead store is not an empty
    one on a dashboard."""
    server = request.getfixturevalue("own_server") if fault != "raising" else None
    stores = request.getfixturevalue("failing_stores") if fault == "raising" else []
    url = None if server is None else url_of(server)
    service = build(l3_config(tmp_path / "l3", url=url, timeout_s=0.3, interval_s=60.0),
                    tmp_path.name)
    try:
        if server is not None and fault == "killed":
            server.kill()
        elif server is not None:
            server.pause()
        for store in stores:
            store.failing = True
        prefetch = start(service, TOKENS)
        assert service.wait_prefetch(prefetch, timeout_s=LIVENESS_S)
        assert service.finish_prefetch(prefetch) == 0
        tokens = {k: v for k, v in tier_of(service).stats.prefetch_tokens.items() if v}
        assert tokens == {outcome: len(TOKENS)}
        service.check_integrity()
    finally:
        if server is not None and fault == "paused":
            server.resume()
        service.stop()


def test_a_put_beside_another_writer_of_the_same_page_spares_its_file(tmp_path: Path) -> None:
    """Two file stores of one process (two services on one directory, as in test_l3_stress)
    name their temporary files ``.<page>.<pid>.<n>.tmp`` with ``n`` counted from 0 by each:
    while one writes page P under ``n = 0``, the other's first put of P picks the same
    name. That put must store P (or find it stored) and leave the other's file alone; it
    reports ERROR and deletes the file (the other writer's publish then fails too)."""
    pool = make_pool()
    ns = namespace(pool)
    keys = hashes(1, seed=3)
    mine = FileStore(tmp_path, ns)
    try:
        name = keys[0].hex() + ".kv"
        theirs = mine.directory / name[:2] / f".{name}.{os.getpid()}.0.tmp"
        theirs.parent.mkdir()
        theirs.write_bytes(b"the other store's page, half written")
        result = mine.put(keys, views(pool, 1, 1))
        assert result.statuses == (PageStatus.OK,), result.error
        assert theirs.exists(), "the other writer's temporary file was deleted"
    finally:
        mine.close()


def test_a_removed_store_directory_is_made_again(tmp_path: Path) -> None:
    """The file store's directory removed while the engine runs (a cache cleaned by hand,
    a tmpfs emptied): the next backups must make it again and store their pages, as the
    first call did; every put fails from then on instead (``mkdir`` of the page's
    subdirectory without its parents), counted but never logged."""
    service = build(l3_config(tmp_path / "l3", interval_s=60.0), tmp_path.name)
    try:
        put(service, TOKENS[:8])
        quiesce(service)
        shutil.rmtree(namespace_dir(tmp_path / "l3"))
        put(service, TOKENS[8:16])
        quiesce(service)
        assert tier_of(service).stats.backup_pages == {"stored": 8, "failed": 0}
        service.check_integrity()
    finally:
        service.stop()


def test_failed_puts_are_logged_once_when_they_start_and_when_they_end(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The store's directory replaced by a file: every put fails; the first failure is one
    WARNING with the store's message, the next ones DEBUG lines only, and the first put
    stored after the directory is back one INFO line."""
    service = build(l3_config(tmp_path / "l3", interval_s=60.0), tmp_path.name)
    caplog.set_level("DEBUG", logger="hicache.l3")
    try:
        put(service, TOKENS[:4])
        quiesce(service)
        directory = namespace_dir(tmp_path / "l3")
        shutil.rmtree(directory)
        directory.write_bytes(b"")
        for first in (0, 4, 8):
            put(service, TOKENS[8 + first:12 + first])
            quiesce(service)
        directory.unlink()
        put(service, TOKENS[20:24])
        quiesce(service)
        assert tier_of(service).stats.backup_pages == {"stored": 4, "failed": 6}
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if "puts" in r.getMessage()]
        assert [level for level, _ in lines] == ["WARNING", "DEBUG", "DEBUG", "INFO"], lines
        assert "Not a directory" in lines[0][1], lines[0][1]
    finally:
        service.stop()
