"""Audit of what an operator watches and what the demo reports, with reproducers:

- ``hicache_refused_backup_tokens_total`` knew one reason (``host_full``) where the tree
  counts two: a window backup the SWA host pool had no room for (``host_swa_full``) was a
  series missing from the first scrape and from the README;
- ``hicache demo --storage`` counted a page stored by both instances twice (the second
  instance's put of a page already there writes nothing), and called every page its second
  instance checked "verified against the first instance's backups", its own included;
- the demo printed ``http://::1:PORT/metrics`` for an IPv6 metrics host, which is no URL.
"""

from __future__ import annotations

import dataclasses
import socket
import urllib.parse
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_service import make_config
from test_swa_history import serve

from hicache.config import load_default_config
from hicache.controller import HybridCacheController
from hicache.engine import DemoOptions, run_demo, store_pages, verify
from hicache.factory import build_service

NAME = "hicache_refused_backup_tokens_total"


def reasons(service) -> dict[str, float]:
    text = service.exporter.render().decode()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == NAME}


def test_every_refused_backup_reason_is_exported_from_the_first_scrape() -> None:
    service = build_service(make_config(hybrid=True, metrics=True))
    service.start()
    try:
        first = reasons(service)
        controller = service.controller
        assert isinstance(controller, HybridCacheController)
        allocator = controller.host_swa.allocator
        squatter = allocator.try_alloc(allocator.num_free_tokens)  # SWA host pool full
        serve(service, list(range(1, 13)))  # releases the SWA rows of 8 tokens: refused
        assert service.tree.stats.refused_backups["host_swa_full"] == 8
        later = reasons(service)
        allocator.free(squatter)
        # the tree counted 8 refused tokens under a reason the metric now shows ...
        assert later.get("host_swa_full") == 8
        # ... but the first scrape did not have that series (a label value known in advance)
        assert set(first) == set(later), (first, later)
    finally:
        service.stop()


def test_pages_stored_is_what_the_store_holds(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    report = run_demo(load_default_config(), DemoOptions(quick=True, storage=str(store)),
                      "default")
    assert report.passed, report.failure()
    in_store = sum(1 for _ in store.rglob("*.kv"))  # one object per page, nothing evicted
    assert in_store > 0
    assert report.l3 is not None
    assert report.l3["stored_pages"] == in_store, (
        f"demo says {report.l3['stored_pages']} pages stored, the store holds {in_store}")


def test_pages_said_verified_against_the_first_instance_are(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    audits: list[verify.TransferAudit] = []
    origin: dict[int, dict[str, dict[int, str]]] = {}
    counts: dict[int, Counter[str]] = {}
    watch, remember, check = (store_pages.StorePageAudit.watch,
                              verify.TransferAudit._remember, verify.TransferAudit._check)

    def traced_watch(self, service, audit):  # type: ignore[no-untyped-def]
        watch(self, service, audit)
        audits.append(audit)
        slots = origin.setdefault(id(audit), {"full": {}, "swa": {}})
        counts[id(audit)] = Counter()

        def arrived(event, hashes, host, swa):  # type: ignore[no-untyped-def]
            if event == "arrive":
                slots["full"].update(dict.fromkeys(host.tolist(), "first instance"))
                if swa is not None:
                    slots["swa"].update(dict.fromkeys(swa.tolist(), "first instance"))

        service.storage.observers.append(arrived)

    def traced_remember(self, pool, device, host):  # type: ignore[no-untyped-def]
        remember(self, pool, device, host)
        if id(self) in origin:
            origin[id(self)][pool].update(dict.fromkeys(host.tolist(), "own"))

    def traced_check(self, load):  # type: ignore[no-untyped-def]
        pages = check(self, load)
        if id(self) in origin:
            page = self.controller.device_allocator.page_size
            for start in range(0, len(load.host_slots), page):
                counts[id(self)][origin[id(self)][load.pool].get(
                    int(load.host_slots[start]), "own")] += 1
        return pages

    monkeypatch.setattr(store_pages.StorePageAudit, "watch", traced_watch)
    monkeypatch.setattr(verify.TransferAudit, "_remember", traced_remember)
    monkeypatch.setattr(verify.TransferAudit, "_check", traced_check)
    report = run_demo(load_default_config(), DemoOptions(quick=True, storage="file"),
                      "default")
    assert report.passed and report.l3 is not None
    second = counts[id(audits[1])]
    assert report.l3["second_pages_checked"] == sum(second.values())
    claimed = report.l3["second_store_pages_checked"]
    assert claimed == second["first instance"], (
        f"demo: {claimed} loaded pages verified against the first instance's backups; "
        f"really {second['first instance']} (and {second['own']} against the second "
        f"instance's own backups)")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_printed_metrics_url_of_an_ipv6_host_is_a_url() -> None:
    config = load_default_config()
    config = dataclasses.replace(config, service=dataclasses.replace(
        config.service, metrics_host="::1", metrics_port=0))
    report = run_demo(config, DemoOptions(quick=True), "default")
    assert report.passed
    url = report.metrics
    parts = urllib.parse.urlsplit(url)
    # a URL names an IPv6 host in brackets: http://[::1]:PORT/metrics
    assert parts.hostname == "::1", f"{url!r} does not name host ::1"
    assert parts.port is not None and parts.port > 0, url
