"""Audit of bad input in the configuration and on the command line, third round: durations
past the longest wait Python can make, pools past 2**63 bytes, a RAM error naming the key
at fault, config paths that are no regular file, and output paths through a symbolic link.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from storage_helpers import hashes, make_pool, namespace
from test_config_cli_audit_2 import cli

from hicache import ConfigError, config_from_dict
from hicache.config import GIB, default_config_text, load_config, loading
from hicache.storage import FileStore
from hicache.storage.base import Deadline

TOO_LONG_S = threading.TIMEOUT_MAX * 2  # 1.8e10 s: a typo for "no deadline"


def default_dict() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(default_config_text())
    data["service"]["metrics_enabled"] = False
    return data


@pytest.mark.parametrize("section, key", [
    ("service", "integrity_check_interval_s"), ("storage", "timeout_s"),
    ("storage", "prefetch_timeout_s"), ("storage", "prefetch_timeout_max_s"),
    ("storage", "prefetch_timeout_per_1024_tokens_s")])
def test_a_duration_past_the_longest_wait_is_a_config_error(section: str, key: str) -> None:
    """``integrity_check_interval_s: 1e10`` used to load and then kill the background thread
    at its first sleep (``OverflowError``); ``storage.timeout_s`` every Redis call."""
    data = default_dict()
    if section == "storage":
        data["storage"] = {"backend": "file", "path": "/tmp/unused-store"}
    data[section][key] = TOO_LONG_S
    if key == "prefetch_timeout_s":
        data[section]["prefetch_timeout_max_s"] = TOO_LONG_S
    with pytest.raises(ConfigError, match=rf"{section}\.{key} = .*the longest wait Python "
                                          rf"can make"):
        config_from_dict(data, check_ram=False)


def test_the_longest_wait_itself_loads() -> None:
    data = default_dict()
    data["service"]["integrity_check_interval_s"] = threading.TIMEOUT_MAX
    config_from_dict(data, check_ram=False)


def test_a_store_refuses_a_deadline_past_the_longest_wait(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the longest wait Python can make"):
        Deadline(TOO_LONG_S)
    with FileStore(tmp_path, namespace(make_pool())) as store, \
            pytest.raises(ValueError, match="timeout_s"):
        store.exists(hashes(1), timeout_s=TOO_LONG_S)


def test_check_config_of_a_redis_deadline_past_the_longest_wait_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It used to connect with that deadline and end in an ``OverflowError`` traceback."""
    data = default_dict()
    data["storage"] = {"backend": "redis", "url": "redis://127.0.0.1:1", "timeout_s": 1e10}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    code, _, err = cli(["check-config", str(path)], capsys)
    assert code == 2 and err.startswith("hicache: error: ") and "storage.timeout_s" in err, err


@pytest.mark.parametrize("key", ["num_tokens", "swa_num_tokens"])
def test_a_device_pool_of_2_63_bytes_or_more_is_a_config_error(key: str) -> None:
    """One full layer and 63 SWA layers: 2**53 tokens make a full pool of 2**62 bytes
    (taken) and an SWA pool 63 times that (refused, naming its key)."""
    data = default_dict()
    data["model"].update(num_layers=64, swa_layers=list(range(1, 64)))
    data["device_pool"].update(device="cuda", num_tokens=2**53, swa_num_tokens=2**53)
    if key == "num_tokens":
        data["device_pool"].update(num_tokens=2**60, swa_num_tokens=1024)
    data["host"]["ratio"] = 1e-12
    with pytest.raises(ConfigError, match=rf"device_pool\.{key} = .*more than 2\*\*63"):
        config_from_dict(data, check_ram=False)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_reserve_larger_than_the_ram_is_the_key_named(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lowering the device pool cannot fix a reserve that takes all the RAM (the error named
    ``device_pool.num_tokens``, also for a CUDA pool, which takes no RAM)."""
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: 8 * GIB)
    data = default_dict()
    data["device_pool"]["device"] = device
    data["host"]["ram_reserve_gib"] = 16.0
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.key == "host.ram_reserve_gib", str(info.value)
    assert "lower host.ram_reserve_gib below 8.00" in str(info.value)


def test_a_cpu_device_pool_larger_than_the_ram_names_the_device_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "available_ram_bytes", lambda: 8 * GIB)
    data = default_dict()
    data["device_pool"]["num_tokens"] = 2**36  # far past 8 GiB of rows
    data["host"]["ram_reserve_gib"] = 1.0
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert info.value.key == "device_pool.num_tokens", str(info.value)


def test_a_fifo_is_not_read_as_a_config(tmp_path: Path) -> None:
    """Reading a pipe blocks until a writer comes: refused before it is opened (run in a
    child, so that a regression hangs the child, not the suite)."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    code = ("from hicache.config import ConfigError, load_config\n"
            f"try:\n    load_config({str(fifo)!r})\n"
            "except ConfigError as exc:\n    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert "not a regular file" in result.stdout, result.stdout + result.stderr


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))


def test_check_config_of_a_device_is_one_line() -> None:
    """``/dev/zero`` was read until memory ran out (a child with 4 GiB of address space, so
    that a regression fails there)."""
    result = subprocess.run([sys.executable, "-m", "hicache.cli", "check-config", "/dev/zero"],
                            capture_output=True, text=True, timeout=120, check=False,
                            preexec_fn=_limit_memory)
    assert result.returncode == 2 and result.stderr == (
        "hicache: error: /dev/zero: not a regular file (a device, a pipe or a socket); give "
        "the path of a YAML config file\n"), result.stderr[-800:]


def test_a_config_file_past_the_size_cap_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    with open(path, "wb") as out:
        out.truncate(loading.MAX_CONFIG_BYTES + 1)  # sparse: no disk
    with pytest.raises(ConfigError, match="more than a config file holds"):
        load_config(path)


def test_a_config_through_a_symbolic_link_loads(tmp_path: Path) -> None:
    real = tmp_path / "real.yaml"
    real.write_text(default_config_text())
    (tmp_path / "link.yaml").symlink_to(real)
    load_config(tmp_path / "link.yaml", check_ram=False)


def test_init_through_a_dangling_link_writes_its_file_and_keeps_the_link(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The output check used to create the link's file, then remove the link (it "did not
    exist"), leaving an empty file behind and a regular file where the link was."""
    (tmp_path / "target").mkdir()
    link, real = tmp_path / "link.yaml", tmp_path / "target" / "real.yaml"
    link.symlink_to(real)
    code, _, err = cli(["init", str(link)], capsys)
    assert code == 0, err
    assert link.is_symlink() and real.read_text() == default_config_text()


def test_a_json_output_through_a_dangling_link_leaves_nothing_when_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The check's own file is removed when the command stops before writing (here the
    config is refused), and the link stays as it was."""
    (tmp_path / "target").mkdir()
    link, real = tmp_path / "out.json", tmp_path / "target" / "out.json"
    link.symlink_to(real)
    bad = tmp_path / "bad.yaml"
    bad.write_text("page_size_tokens: 0\n")
    code, _, _ = cli(["demo", "--quick", "--config", str(bad), "--json", str(link)], capsys)
    assert code == 2
    assert link.is_symlink() and not real.exists()
