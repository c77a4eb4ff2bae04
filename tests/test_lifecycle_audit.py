"""Audit of a service's whole life as an engine author and an operator live it: a build
that fails part-way, ``start`` on a taken or foreign metrics address, ``with`` on a normal
and an exceptional exit, ``stop`` with work in every stage, calls after ``stop``, and many
services built and stopped in one process.

Every failure must name the config key to change and leave nothing behind: no thread, no
listening socket, no open file, no pool or service kept alive (counted after
``gc.collect()``). Interrupts, the background thread's failures and ``stop`` from another
thread are in ``test_lifecycle_audit_2.py``.
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import threading
import time
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_api_input_audit import raw_config
from test_service_refusals import put

from hicache import (
    ConfigError,
    HiCacheConfig,
    IndexSpace,
    Indices,
    build_service,
    config_from_dict,
    load_config,
)
from hicache.bench.redis_local import free_port
from hicache.l3 import StorageTier
from hicache.l3.worker import StorageWorker
from hicache.metrics import MetricsExporter
from hicache.pools import HostKVPool
from hicache.radix import HiRadixCache
from hicache.service import HiCacheService

MODEL = {"model_id": "test/model", "model_revision": "r1"}
A = [1, 1, 2, 2, 3, 3]
TRACKED = (HiCacheService, HostKVPool, HiRadixCache, StorageTier, MetricsExporter)


def make_config(*, metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                storage: dict[str, Any] | None = None, hybrid: bool = False,
                host: dict[str, Any] | None = None, interval_s: float = 3600.0
                ) -> HiCacheConfig:
    """test_api_input_audit's small write-through config; metrics only with a port (0: a
    free one); the RAM check is left to the tests about it."""
    data = raw_config(hybrid=hybrid, storage=storage)
    data["service"] = {"metrics_enabled": metrics_port is not None,
                       "metrics_host": metrics_host, "metrics_port": metrics_port or 0,
                       "integrity_check_interval_s": interval_s}
    if host is not None:
        data["host"] = host
    return config_from_dict(data, check_ram=False)


def file_store(path: Path, **more: Any) -> dict[str, Any]:
    """A ``storage`` section: a file store at ``path`` that prefetches any tail."""
    return {"backend": "file", "path": str(path), "prefetch_threshold_tokens": 0, **more}


@dataclass(frozen=True)
class Footprint:
    """What a process holds that a service could leave behind."""

    threads: frozenset[str]
    fds: int
    objects: tuple[tuple[str, int], ...]


def footprint() -> Footprint:
    """Live threads, open descriptors and live service parts, after a full collection."""
    gc.collect()
    objects = gc.get_objects()
    counts = tuple((kind.__name__, sum(type(o) is kind for o in objects)) for kind in TRACKED)
    del objects
    threads = frozenset(f"{t.name}#{t.ident}" for t in threading.enumerate())
    return Footprint(threads, len(os.listdir("/proc/self/fd")), counts)


def settled_footprint(before: Footprint) -> Footprint:
    """:func:`footprint` once it equals ``before`` or after a generous deadline (a scrape's
    handler thread may still be closing its connection)."""
    deadline = time.monotonic() + 10.0
    while True:
        now = footprint()
        if now == before or time.monotonic() > deadline:
            return now
        time.sleep(0.01)



def can_bind(port: int) -> bool:
    """Whether a new server could listen on ``port`` now (as the endpoint binds it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        sock.listen()
        return True


def scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return int(response.status)


def build_error(config: HiCacheConfig, **kwargs: str) -> str:
    """The message of the exception ``build_service`` raises (its traceback, which holds
    the half-built parts, is dropped before returning)."""
    try:
        build_service(config, **kwargs).stop()
    except Exception as exc:  # the audit reads any error's message
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("build_service did not fail")


# ---- build_service failing part-way ---------------------------------------------------------


def test_a_store_path_that_is_a_file_is_refused_naming_storage_path(tmp_path: Path) -> None:
    """storage.path names a file (found after the pools exist): the error names the key."""
    (tmp_path / "taken").write_text("not a directory")
    message = build_error(make_config(storage=file_store(tmp_path / "taken")), **MODEL)
    assert "storage.path" in message, message


def test_a_store_path_that_cannot_be_made_is_refused_naming_storage_path(tmp_path: Path
                                                                         ) -> None:
    """storage.path below a file cannot be made: the error names the key."""
    (tmp_path / "taken").write_text("not a directory")
    message = build_error(make_config(storage=file_store(tmp_path / "taken" / "l3")), **MODEL)
    assert "storage.path" in message, message


def test_a_store_that_cannot_open_leaves_nothing_behind(tmp_path: Path) -> None:
    """Pools, controller and tree built before the store failed are all released."""
    (tmp_path / "taken").write_text("not a directory")
    for hybrid in (False, True):
        before = footprint()
        build_error(make_config(hybrid=hybrid, storage=file_store(tmp_path / "taken")),
                    **MODEL)
        assert footprint() == before


def test_an_impossible_host_size_is_refused_at_load_naming_the_key(tmp_path: Path) -> None:
    """load_config's RAM check names the path, host.size_gib and the fix."""
    path = tmp_path / "config.yaml"
    data = raw_config()
    path.write_text(
        "page_size_tokens: 2\n"
        f"model: {data['model']}\n"
        f"device_pool: {data['device_pool']}\n"
        "host: {size_gib: 1000000000.0}\n"
        "service: {metrics_enabled: false}\n", encoding="utf-8")
    before = footprint()
    with pytest.raises(ConfigError, match=rf"^{path}: host\.size_gib = 1000000000\.0: host "
                       r"and CPU device pools need .* GiB .*; lower host\.size_gib to at "
                       r"most .*, lower host\.ram_reserve_gib, or free memory$"):
        load_config(path)
    assert footprint() == before


def test_host_pools_too_large_for_this_machine_are_refused_naming_the_key() -> None:
    """Built without the RAM check, too-large host pools fail naming host.size_gib."""
    config = make_config(host={"size_gib": 1e9, "ram_reserve_gib": 0.0})
    before = footprint()
    message = build_error(config)
    assert footprint() == before
    assert "host.size_gib" in message, message


def test_a_backend_this_device_cannot_use_is_refused_naming_io_backend() -> None:
    """io_backend: direct on CPU pools is refused naming the key, allocating nothing."""
    data = raw_config()
    data["controller"]["io_backend"] = "direct"
    before = footprint()
    try:
        build_service(config_from_dict(data, check_ram=False)).stop()
    except ValueError as exc:  # a ConfigError is one
        message = str(exc)
    else:
        raise AssertionError("io_backend: direct was accepted for CPU pools")
    assert footprint() == before
    assert "io_backend" in message and "torch or auto for CPU pools" in message, message


# ---- start(): the metrics address -----------------------------------------------------------


def test_a_metrics_port_another_service_serves_is_a_clear_error(tmp_path: Path) -> None:
    """A second service on a served port: OSError naming the port and the fix."""
    port = free_port()
    with build_service(make_config(metrics_port=port)) as first:
        second = build_service(make_config(metrics_port=port))
        with pytest.raises(OSError) as info, second:
            pytest.fail("the body of a service that did not start ran")
        assert info.value.errno == errno.EADDRINUSE
        assert str(info.value) == (
            f"[Errno {errno.EADDRINUSE}] metrics endpoint: cannot bind 127.0.0.1:{port} "
            f"(Address already in use: another process, or another engine worker on this "
            f"host, has it; give each worker its own port, e.g. {port} + its rank); set "
            f"service.metrics_port to a free port, or 0 to pick one")
        assert scrape(port) == 200
        put(first, A)
    assert can_bind(port)


def test_a_taken_metrics_port_leaves_nothing_behind(tmp_path: Path) -> None:
    """A service refused its port by ``with`` (store and all) leaves nothing behind."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        before = footprint()
        config = make_config(metrics_port=port, storage=file_store(tmp_path / "l3"))
        refused = False
        try:
            with build_service(config, **MODEL):
                pass
        except OSError:
            refused = True
        assert refused
        assert footprint() == before


def test_a_metrics_host_of_another_machine_is_refused_naming_metrics_host() -> None:
    """A metrics_host of no machine here: the fix named is service.metrics_host."""
    config = make_config(metrics_port=0, metrics_host="192.0.2.1")
    service = build_service(config)
    with pytest.raises(OSError) as info, service:
        pass
    assert info.value.errno == errno.EADDRNOTAVAIL
    assert "service.metrics_host" in str(info.value), str(info.value)
    assert service.exporter is not None and service.exporter.port is None


def test_two_services_on_port_zero_serve_on_their_own_ports() -> None:
    """metrics_port: 0 twice: two free ports, both answer, both closed after stop."""
    with build_service(make_config(metrics_port=0)) as first, \
            build_service(make_config(metrics_port=0)) as second:
        assert first.exporter is not None and second.exporter is not None
        ports = (first.exporter.port, second.exporter.port)
        assert None not in ports and ports[0] != ports[1]
        assert [scrape(p) for p in ports if p is not None] == [200, 200]
    assert all(can_bind(p) for p in ports if p is not None)


def test_two_services_on_distinct_fixed_ports_both_serve() -> None:
    """Two configured ports (9400 + rank, as the README advises): both answer."""
    ports = (free_port(), free_port())
    with build_service(make_config(metrics_port=ports[0])) as first, \
            build_service(make_config(metrics_port=ports[1])) as second:
        assert first.exporter is not None and second.exporter is not None
        assert (first.exporter.port, second.exporter.port) == ports
        assert [scrape(p) for p in ports] == [200, 200]
    assert all(can_bind(p) for p in ports)


# ---- with / stop -----------------------------------------------------------------------------


def test_with_stops_on_a_normal_exit(tmp_path: Path) -> None:
    """Thread, endpoint, store workers and host memory all end with the block."""
    before = footprint()
    port = free_port()
    config = make_config(metrics_port=port, storage=file_store(tmp_path / "l3"))
    with build_service(config, **MODEL) as service:
        put(service, A)
        assert scrape(port) == 200
    assert can_bind(port)
    for pool in service._host_pools:
        with pytest.raises(RuntimeError, match=r"^host pool '\w+' is closed$"):
            _ = pool.data
    del pool
    ref = weakref.ref(service)
    del service
    assert settled_footprint(before) == before
    assert ref() is None


def test_with_stops_on_an_exception_and_lets_it_through() -> None:
    """The body's own exception propagates unchanged; the service is stopped."""
    port = free_port()
    with pytest.raises(KeyError, match="the engine's own") as info, \
            build_service(make_config(metrics_port=port)) as service:
        put(service, A)
        raise KeyError("the engine's own")
    assert info.value.__context__ is None
    assert can_bind(port)
    with pytest.raises(RuntimeError, match=r"^the service was stopped$"):
        service.match(A)


def test_stop_is_idempotent_and_start_after_it_is_refused() -> None:
    """A second and third stop return quietly; start names the fix."""
    service = build_service(make_config(metrics_port=0))
    service.start()
    put(service, A)
    for _ in range(2):
        service.stop()
    with pytest.raises(RuntimeError, match=r"^the service was stopped; build a new one$"):
        service.start()
    service.stop()


def test_stop_of_a_service_never_started_releases_its_store(tmp_path: Path) -> None:
    """The store's workers (started by its first job) end at stop without start."""
    before = footprint()
    service = build_service(make_config(storage=file_store(tmp_path / "l3")), **MODEL)
    put(service, A)
    service.stop()
    del service
    assert footprint() == before


def test_a_service_with_a_store_dropped_unstarted_leaves_nothing_behind(tmp_path: Path
                                                                        ) -> None:
    """A service with a store dropped before start leaves no thread and no pool alive."""
    before = footprint()
    service = build_service(make_config(storage=file_store(tmp_path / "l3")), **MODEL)
    del service
    try:
        assert footprint() == before
    finally:  # what a leak found here left running must not run on into later tests
        for worker in [o for o in gc.get_objects() if type(o) is StorageWorker]:
            worker.close()


def test_stop_applies_queued_backups_started_loads_and_window_copies() -> None:
    """stop acks a started load, a window copy and a queued backup; nothing stays locked."""
    service = build_service(make_config(hybrid=True))  # unstarted: nothing else acks them
    put(service, A)
    service.evict(10**6)
    assert service.load_back(service.match(A), 64).queued
    service.start_loading()
    held = service.alloc_device(8)
    assert held is not None
    service.release_window(Indices(held.tensor[:2], IndexSpace.DEVICE_FULL))
    service.insert([7, 7, 8, 8], Indices(held.tensor[4:], IndexSpace.DEVICE_FULL))
    assert service.controller.num_in_flight > 0 and service.tree.has_queued_backups
    service.stop()
    assert service.controller.num_in_flight == 0 and not service.tree.has_queued_backups
    assert sorted((n.tokens, n.lock_count, n.host is not None)
                  for n in service.tree.nodes()) == [(tuple(A), 0, True), ((7, 7, 8, 8), 0, True)]
    service.check_integrity()


def test_what_is_documented_to_work_after_stop_does(tmp_path: Path) -> None:
    """key(), check_integrity(), engine_held_tokens and the metrics text work after stop."""
    service = build_service(make_config(metrics_port=0))
    put(service, A)
    service.stop()
    assert service.key(A).num_tokens == len(A)
    service.check_integrity()
    assert service.engine_held_tokens == 0
    assert service.exporter is not None
    text = service.exporter.render().decode()
    assert "hicache_inserted_tokens_total 6.0" in text.splitlines()
    assert "hicache_l3_enabled 0.0" in text.splitlines()


@pytest.mark.parametrize("op", ["prefetch_ready", "wait_prefetch", "finish_prefetch"])
def test_the_store_calls_after_stop_are_refused(tmp_path: Path, op: str) -> None:
    """A prefetch still held, used after stop: RuntimeError, as for every call."""
    service = build_service(make_config(storage=file_store(tmp_path / "l3")), **MODEL)
    key = service.key(list(range(40, 50)))
    prefetch = service.prefetch(key, service.match(key))
    assert prefetch is not None
    service.stop()
    with pytest.raises(RuntimeError, match=r"^the service was stopped$"):
        getattr(service, op)(prefetch)


# ---- many services in one process ------------------------------------------------------------


def test_fifty_services_built_and_stopped_leave_nothing_behind() -> None:
    """Threads, descriptors and live services stay flat over 50 lives with metrics."""
    before = footprint()
    refs = []
    for i in range(50):
        with build_service(make_config(metrics_port=0, hybrid=bool(i % 2))) as service:
            put(service, [i, i, 1, 1])
            service.step()
        refs.append(weakref.ref(service))
        del service
    assert footprint() == before
    assert [ref for ref in refs if ref() is not None] == []
