"""``hicache demo``, ``check-config`` and ``init`` at their edges, each found by an audit:

- A config whose ``storage`` section ``check-config`` accepts made ``demo --config`` fail,
  telling the user to pass ``build_service``'s ``model_id``/``model_revision``, which no
  option can: the demo now serves the config's store as it serves ``--storage``'s.
- The config's own refusals of ``storage.url`` printed its password.
- ``init PATH --force`` with PATH a FIFO hung in the output check's ``open``.
- A CUDA config on a machine without CUDA was told "pass --device cpu", which its CUDA-only
  ``io_backend`` then refused; ``--device cpu`` with such a backend was refused by the config
  with advice naming no option.
- ``demo --json ''`` was ignored (exit 0, no report); ``demo --storage`` with a hybrid model
  keeping SWA rows for windows only was refused after the baseline ran, advising
  ``storage.backend: none``, which it already was.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hicache.cli import main
from hicache.config import default_config_text


def default_dict() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(default_config_text())
    data["service"]["metrics_enabled"] = False
    return data


def write(tmp_path: Path, data: dict[str, Any]) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


def test_demo_serves_a_config_whose_storage_section_check_config_accepts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = default_dict()
    data["storage"].update(backend="file", path=str(tmp_path / "pages"))
    path = write(tmp_path, data)
    assert main(["check-config", path]) == 0
    capsys.readouterr()
    code = main(["demo", "--config", path, "--quick", "--conversations", "2", "--turns", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "the config's store" in out and str(tmp_path / "pages") in out, out
    assert any((tmp_path / "pages").rglob("*")), "no page reached the config's store"


@pytest.mark.parametrize("storage", [
    {"backend": "redis", "url": "redis://:s3cret@h:99999"},  # a bad port
    {"url": "redis://:s3cret@h:6379"},  # backend none
    {"backend": "file", "path": "/tmp/x", "url": "redis://:s3cret@h:6379"},
    {"backend": "redis", "url": "redis://:s3cret@h:6379", "nodes": ["h:7000"]},
])
def test_config_errors_never_print_a_redis_password(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], storage: dict[str, Any]) -> None:
    data = default_dict()
    data["storage"] = storage
    code = main(["check-config", "--skip-storage-check", write(tmp_path, data)])
    err = capsys.readouterr().err
    assert code == 2
    assert "s3cret" not in err and "storage." in err, err


def test_init_force_onto_a_pipe_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    try:
        done = subprocess.run([sys.executable, "-m", "hicache.cli", "init", str(fifo),
                               "--force"], capture_output=True, text=True, timeout=60,
                              check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("hicache init --force on a FIFO hung")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "not a regular file" in done.stderr, done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the advice is for a machine without CUDA")
def test_the_advice_for_a_cuda_config_on_a_cpu_machine_names_the_backend(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = default_dict()
    data["device_pool"]["device"] = "cuda"
    data["controller"]["io_backend"] = "staged"
    path = write(tmp_path, data)
    assert main(["demo", "--config", path]) == 2
    first = capsys.readouterr().err
    assert "controller.io_backend: auto" in first and "device_pool.device: cpu" in first, first
    assert main(["demo", "--config", path, "--device", "cpu"]) == 2
    second = capsys.readouterr().err
    assert second.startswith("hicache: error: --device cpu: controller.io_backend = 'staged'")
    data["device_pool"]["device"] = "cpu"
    data["controller"]["io_backend"] = "auto"  # what the advice says
    code = main(["demo", "--config", write(tmp_path, data), "--quick", "--conversations", "1",
                 "--turns", "1"])
    assert code == 0, capsys.readouterr().err


def test_demo_refuses_an_empty_json_path(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--quick", "--conversations", "1", "--turns", "1", "--json", ""])
    err = capsys.readouterr().err
    assert code == 2, "an empty --json was ignored"
    assert err.startswith("hicache: error: --json"), err


def test_demo_storage_with_window_tails_names_the_option_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = default_dict()
    data["host"]["swa_history"] = "window_tails"
    code = main(["demo", "--config", write(tmp_path, data), "--quick", "--conversations", "1",
                 "--turns", "1", "--storage", "file"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("hicache: error: --storage file:") and "drop --storage" in err, err
    assert "baseline" not in out + err  # refused before any work
