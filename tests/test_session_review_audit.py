"""A review of this session's changes, each case failing before its fix:

- ``hide_password`` stopped at a URL's first ``@`` where the parser takes the password to its
  last, and a password with ``/``, ``?`` or ``#`` leaked through the parser's own text.
- The RAM refusal's search for the most that fits took "smaller than a page" for "too big"
  and offered no size where a smaller one fit.
- Sections made in Python refused numpy numbers (``np.int64(2048)`` tokens).
- ``MetricsExporter.stop()`` waited forever for a scrape blocked on the source lock that the
  stopping thread held.
- ``bench scheduler --sizes`` not making a whole number of pages was refused as too large
  for the RAM.
"""
from __future__ import annotations

import dataclasses
import re
import socket
import threading
import time

import numpy as np
import pytest
import yaml

from hicache.config import ConfigError, check_machine_memory, config_from_dict, default_config_text
from hicache.config.loading import total_ram_bytes
from hicache.config.storage import StorageConfig, StorageKind
from hicache.controller.stats import TransferStats
from hicache.metrics.exporter import MetricsExporter


def default_dict() -> dict:
    data = yaml.safe_load(default_config_text())
    data["service"]["metrics_port"] = 0
    return data


# 1 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", [
    "redis://:pw1@pw2@127.0.0.1:6379",      # parse_location takes it: password 'pw1@pw2'
    "redis://:pw1/pw2@127.0.0.1:6379",      # a '/' (or '?', '#') in an unencoded password
    "redis://:pw1?pw2@127.0.0.1:6379",
])
@pytest.mark.parametrize("backend", ["none", "redis"])
def test_a_refused_storage_url_never_prints_any_part_of_its_password(url: str, backend: str
                                                                      ) -> None:
    try:
        StorageConfig(backend=StorageKind(backend), url=url)
    except ConfigError as exc:
        assert "pw1" not in str(exc) and "pw2" not in str(exc), str(exc)


# 2 ------------------------------------------------------------------------------------------
def test_the_ram_refusal_offers_the_host_ratio_that_fits() -> None:
    # hybrid, swa_history window_tails: a ratio below 1.0 gives the one-page SWA pool no
    # page (refused as too small); ratio 1.0 fits in this machine's RAM, 4.0 does not
    page, heads = 4096, 8
    head_dim = max(1, round(total_ram_bytes() / 6.5 / (page * 2 * heads * 4)))  # page ~ RAM/6.5
    data = default_dict()
    data["page_size_tokens"] = page
    data["model"].update(num_layers=2, swa_layers=[1], window_tokens=page, num_kv_heads=heads,
                         head_dim=head_dim, dtype="float32")
    data["device_pool"] = {"num_tokens": 3 * page, "swa_num_tokens": page, "device": "cuda"}
    data["host"] = {"ratio": 4.0, "swa_history": "window_tails", "ram_reserve_gib": 0.0}
    check_machine_memory(config_from_dict({**data, "host": {**data["host"], "ratio": 1.0}},
                                          check_ram=False))  # ratio 1.0 fits
    with pytest.raises(ConfigError) as refused:
        check_machine_memory(config_from_dict(data, check_ram=False))
    found = re.search(r"lower host\.ratio to at most ([0-9.]+)", str(refused.value))
    assert found is not None, str(refused.value)
    data["host"]["ratio"] = float(found.group(1))
    check_machine_memory(config_from_dict(data, check_ram=False))  # the value offered is taken


# 3 ------------------------------------------------------------------------------------------
def test_a_section_made_in_python_takes_numpy_numbers() -> None:
    config = config_from_dict(default_dict(), check_ram=False)
    pool = dataclasses.replace(config.device_pool, num_tokens=np.int64(2048))
    assert pool.num_tokens == 2048 and type(pool.num_tokens) is int
    service = dataclasses.replace(config.service, metrics_port=np.int64(9401))
    assert service.metrics_port == 9401
    host = dataclasses.replace(config.host, ratio=np.float32(1.5))
    assert host.ratio == 1.5 and type(host.ratio) is float
    assert dataclasses.replace(config.service, metrics_enabled=np.bool_(False)).metrics_enabled \
        is False


# 4 ------------------------------------------------------------------------------------------
def test_stop_under_the_source_lock_returns_while_a_scrape_waits_for_it() -> None:
    lock = threading.Lock()
    exporter = MetricsExporter(TransferStats(), source_lock=lock)
    port = exporter.start_http("127.0.0.1", 0)
    with lock:  # the engine's lock, held while it shuts down
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        client.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        time.sleep(0.5)  # the scrape is accepted and waits for the lock
        stopper = threading.Thread(target=exporter.stop, daemon=True)
        stopper.start()
        stopper.join(3.0)
        stuck = stopper.is_alive()
    stopper.join(5.0)
    client.close()
    assert not stuck, "stop() under source_lock waits forever for a scrape blocked on the lock"


# 5 ------------------------------------------------------------------------------------------
def test_bench_scheduler_sizes_not_a_page_multiple_are_not_refused_as_ram(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.bench.scheduler_cli import main
    assert main(["--sizes", "1001", "--json", "/nonexistent-dir/out.json"]) == 2
    err = capsys.readouterr().err
    assert "RAM" not in err and "--json" in err, err  # 1001 tokens fit: --json is refused
