"""The metrics endpoint of a real service: only ``/metrics`` answers, ``hicache_build_info``
carries the version, a taken port is a clear error naming it and the fix, and a live scrape
passes ``promtool check metrics``."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import hicache
from hicache import build_service
from hicache.config import HiCacheConfig, config_from_yaml, default_config_text
from hicache.controller.stats import TransferStats
from hicache.metrics import markdown_table
from hicache.metrics.exporter import MetricsBindError, MetricsExporter
from hicache.service import HiCacheService

PROMTOOL_REQUIRED = "HICACHE_REQUIRE_PROMTOOL"


def config_on_port(port: int) -> HiCacheConfig:
    """The built-in default config, serving metrics on ``port``."""
    text = default_config_text().replace("metrics_port: 9400", f"metrics_port: {port}")
    return config_from_yaml(text, "test config")


def promtool() -> str:
    """The promtool binary; skips when absent unless $HICACHE_REQUIRE_PROMTOOL is set (CI)."""
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get(PROMTOOL_REQUIRED):
            pytest.fail(f"promtool is not installed and {PROMTOOL_REQUIRED} is set")
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return path


@pytest.fixture
def service() -> Iterator[HiCacheService]:
    """A running service from the default config, metrics on a free port, after one
    request's worth of calls (allocate, insert, match, step)."""
    with build_service(config_on_port(0)) as running:
        prompt = list(range(64))
        slots = running.alloc_device(len(prompt))
        assert slots is not None
        running.insert(prompt, slots)
        assert len(running.match(prompt).device_indices) == len(prompt)
        running.step()
        yield running


def url(service: HiCacheService, path: str) -> str:
    assert service.exporter is not None and service.exporter.port is not None
    return f"http://127.0.0.1:{service.exporter.port}{path}"


def get(address: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(address, timeout=10) as response:
            return response.status, response.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8")


def test_only_the_metrics_path_answers(service: HiCacheService) -> None:
    """/metrics is the exposition; /, /metrics/x and /favicon.ico are 404 with a hint."""
    status, body = get(url(service, "/metrics"))
    assert status == 200 and "hicache_pool_used_tokens" in body
    for path in ("/", "/metrics/x", "/favicon.ico", "/healthz"):
        assert get(url(service, path)) == (404, "hicache serves its metrics at /metrics only\n")


def test_build_info_carries_the_version(service: HiCacheService) -> None:
    """hicache_build_info{version=...} is 1."""
    _, body = get(url(service, "/metrics"))
    families = {f.name: f for f in text_string_to_metric_families(body)}
    samples = families["hicache_build_info"].samples
    assert [(s.labels, s.value) for s in samples] == [({"version": hicache.__version__}, 1.0)]


def test_taken_port_names_the_port_and_the_fix() -> None:
    """A second worker on the same port: start() raises OSError naming host:port, a port
    per worker and port 0; that service still stops cleanly."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        second = build_service(config_on_port(port))
        with pytest.raises(OSError) as info:
            second.start()
        second.stop()
    assert str(info.value) == (
        f"[Errno {errno.EADDRINUSE}] metrics endpoint: cannot bind 127.0.0.1:{port} (Address "
        f"already in use: another process, or another engine worker on this host, has it; "
        f"give each worker its own port, e.g. {port} + its rank); set service.metrics_port "
        f"to a free port, or 0 to pick one")


def test_an_address_of_no_interface_names_the_host_key() -> None:
    """A ``metrics_host`` that is no address of this machine (TEST-NET-1): the error names
    ``service.metrics_host``, not the port; it is a ``MetricsBindError`` (an ``OSError``)."""
    exporter = MetricsExporter(TransferStats())
    with pytest.raises(MetricsBindError) as info:
        exporter.start_http("192.0.2.1", 0)
    assert info.value.errno == errno.EADDRNOTAVAIL
    assert "set service.metrics_host" in str(info.value)
    assert "metrics_port" not in str(info.value)
    assert exporter.port is None


def test_two_workers_with_their_own_ports_both_serve() -> None:
    """Two services in one host, one port each (as the README's scrape config expects)."""
    with build_service(config_on_port(0)) as first, build_service(config_on_port(0)) as second:
        assert get(url(first, "/metrics"))[0] == get(url(second, "/metrics"))[0] == 200
        assert url(first, "") != url(second, "")


def test_live_scrape_passes_promtool(service: HiCacheService) -> None:
    """promtool check metrics finds nothing to complain about in a live scrape."""
    _, body = get(url(service, "/metrics"))
    result = subprocess.run([promtool(), "check", "metrics"], input=body, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == ""


def test_readme_metric_table_is_current(repo_root: Path) -> None:
    """The README's metric table is markdown_table(), row for row."""
    readme = (repo_root / "README.md").read_text(encoding="utf-8")
    assert markdown_table() in readme
