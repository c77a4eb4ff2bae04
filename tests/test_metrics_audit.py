"""Metrics audit: what an operator's Prometheus reads at the edges of a service's life.

- A scrape accepted just before ``stop()`` was answered after it, once the store was closed:
  every L3 counter read 0, which Prometheus takes for a counter reset.
- ``hicache_l3_store_bytes_total{kind="evicted"}`` counted whole files (a 4 KiB header
  each) where ``written`` and ``read`` count the pages' rows: ``written - evicted`` went
  negative.
- With the metrics endpoint off, the controller kept every timed op's duration for a drain
  that never came (one entry per op on a GPU, for the engine's life).
"""

from __future__ import annotations

import socket
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hicache import build_service
from hicache.config import config_from_dict
from hicache.controller.base import Ack, Direction
from hicache.controller.stats import TransferStats

MODEL = {"model_id": "test/model", "model_revision": "r1"}


def small_config(*, device: str = "cpu", metrics: bool = True, store: Path | None = None):
    """A 2-layer model, page 2, metrics on a free loopback port, optionally a file store."""
    storage = {"backend": "none"} if store is None else {
        "backend": "file", "path": str(store), "write_policy": "write_through",
        "prefetch_policy": "wait_complete", "prefetch_threshold_tokens": 0}
    return config_from_dict({
        "page_size_tokens": 2,
        "model": {"num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": 64, "device": device},
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": metrics, "metrics_port": 0,
                    "integrity_check_interval_s": 60.0},
        "storage": storage,
    })


def counters(text: str) -> dict[tuple[str, tuple], float]:
    """Every counter-like sample (``_total``, histogram parts) of one exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_total", "_bucket", "_count", "_sum")):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_scrape_answered_after_stop_never_sees_counters_go_backwards(tmp_path: Path) -> None:
    """A scrape whose connection the endpoint accepted before ``stop()`` is answered after
    ``stop()`` returned (the port is closed, the request thread lives on) and reports every
    ``hicache_l3_*`` counter at 0: Prometheus reads a counter reset. Either the scrape gets no
    answer, or its counters are not below the scrape before."""
    service = build_service(small_config(store=tmp_path / "l3"), **MODEL)
    service.start()
    slots = service.alloc_device(20)
    service.insert(list(range(100, 120)), slots)
    deadline = time.monotonic() + 10
    while service.storage.stats.backup_pages["stored"] < 10:  # the put to the store is back
        service.step()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    port = service.exporter.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        before = counters(r.read().decode())
    assert before[("hicache_l3_backup_pages_total", (("outcome", "stored"),))] == 10

    scraper = socket.create_connection(("127.0.0.1", port), timeout=10)
    scraper.sendall(b"GET /metrics HTTP/1.0\r\n")  # a scrape on its way
    time.sleep(0.5)  # accepted by the endpoint's thread (it polls every 0.1 s)
    service.stop()
    try:
        scraper.sendall(b"\r\n")
        response = b""
        while chunk := scraper.recv(65536):
            response += chunk
    except OSError:
        response = b""
    finally:
        scraper.close()
    if not response.startswith(b"HTTP/1.0 200"):
        return  # no scrape after stop: fine
    after = counters(response.partition(b"\r\n\r\n")[2].decode())
    backwards = {k: (v, after.get(k)) for k, v in before.items()
                 if after.get(k) is not None and after[k] < v}
    assert backwards == {}, f"counters went backwards in a scrape answered after stop(): " \
                            f"{sorted(backwards.items())[:4]}"


def test_evicted_store_bytes_are_counted_in_the_unit_of_written_bytes(tmp_path: Path) -> None:
    """``hicache_l3_store_bytes_total{kind}`` is one family of page bytes: a page the file
    store's size cap evicts must add what writing it added. It adds the file's size (payload
    and a 4 KiB header) where ``written``/``read`` add the payload: here 65x as much, so
    ``written - evicted`` goes negative although fewer pages left than were written."""
    config = small_config(store=tmp_path / "l3")
    config = replace(config, storage=replace(config.storage,
                                             size_cap_gib=5 * 4160 / 2**30))  # 5 page files
    service = build_service(config, **MODEL)
    with service:
        for i in range(10):
            tokens = list(range(100 * i, 100 * i + 8))
            service.insert(tokens, service.alloc_device(8))
            deadline = time.monotonic() + 10
            while service.storage.stats.backup_pages["stored"] < 4 * (i + 1):
                service.step()
                assert time.monotonic() < deadline
                time.sleep(0.01)
        with urllib.request.urlopen(f"http://127.0.0.1:{service.exporter.port}/metrics",
                                    timeout=10) as r:
            got = counters(r.read().decode())
    pages = {s: got[("hicache_l3_store_pages_total", (("status", s),))]
             for s in ("written", "evicted")}
    size = {k: got[("hicache_l3_store_bytes_total", (("kind", k),))]
            for k in ("written", "evicted")}
    assert pages["evicted"] > 0 and pages["evicted"] <= pages["written"]
    assert size["evicted"] / pages["evicted"] == size["written"] / pages["written"], (pages, size)


def test_a_service_without_metrics_keeps_no_transfer_durations() -> None:
    """The controller's stats keep durations only for the metrics endpoint that drains them
    (ops on a GPU carry one each; on the CPU they carry none, so the flag is what is
    checked here, and the fold it gates below)."""
    with build_service(small_config(metrics=False), **MODEL) as service:
        assert service.controller.stats.keep_durations is False
    with build_service(small_config(metrics=True), **MODEL) as service:
        assert service.controller.stats.keep_durations is True


def test_durations_are_not_kept_when_nothing_drains_them() -> None:
    stats = TransferStats(keep_durations=False)
    for op_id in range(100):
        stats.on_ack(Ack(op_id, Direction.DEVICE_TO_HOST, (), {"kv": 16}, {"kv": 64}, 0.5, "torch"))
    assert stats.ops_acknowledged["device_to_host"] == 100
    assert stats.durations == []
    kept = TransferStats()
    kept.on_ack(Ack(0, Direction.DEVICE_TO_HOST, (), {"kv": 16}, {"kv": 64}, 0.5, "torch"))
    assert kept.drain_durations() == [("device_to_host", 0.5)]
