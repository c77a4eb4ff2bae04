"""``hicache demo`` from the command line: exit codes and one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache.cli import main
from hicache.cli.app import build_parser
from hicache.cli.demo_checks import check_device
from hicache.cli.device import missing_device
from hicache.cli.parser import UsageError
from hicache.config import config_from_dict


def test_demo_quick_exits_zero(repo_root: Path, tmp_path: Path) -> None:
    """``hicache demo --quick`` on the default config verifies and writes its JSON report."""
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "demo", "--quick", "--json", str(report)],
        cwd=repo_root, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "result             PASS" in result.stdout
    data = json.loads(report.read_text())
    assert data["passed"] is True and data["failure"] is None
    assert data["host_hit_tokens"] > 0


def test_the_demo_in_process_prints_its_report_and_exits_zero(
        repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The command itself (not a subprocess): a passing run prints its report, writes the
    JSON and exits 0."""
    monkeypatch.chdir(repo_root)
    report = tmp_path / "report.json"
    assert main(["demo", "--quick", "--json", str(report)]) == 0
    captured = capsys.readouterr()
    assert "result             PASS" in captured.out and captured.err == ""
    assert json.loads(report.read_text())["passed"] is True


def test_a_metrics_host_of_no_interface_is_one_line_and_exit_2(
        default_dict: dict[str, object], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The service's metrics address cannot be bound (a host of no interface here): exit 2
    and one line saying what to set, before any work."""
    service = {**default_dict["service"], "metrics_enabled": True,  # type: ignore[dict-item]
               "metrics_host": "192.0.2.1"}
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({**default_dict, "service": service}), encoding="utf-8")
    assert main(["demo", "--quick", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache: error: ")
    assert re.search(r"192\.0\.2\.1.*set service\.metrics_host", err), err
    assert "[Errno" not in err  # the error's own sentence, not the OSError's repr


def test_the_seed_takes_every_unsigned_64_bit_value() -> None:
    parser = build_parser()
    assert parser.parse_args(["demo", "--seed", str(2**64 - 1)]).seed == 2**64 - 1
    assert parser.parse_args(["demo"]).seed == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--seed", str(2**64)])


def test_bad_config_path_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A missing config file: exit 2 and one line naming the file."""
    assert main(["demo", "--config", "absent.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache: error: absent.yaml: no such config file; ")
    assert err.count("\n") == 1


def test_unknown_config_key_names_the_key(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown key: exit 2 and one line naming the dotted key."""
    path = tmp_path / "config.yaml"
    text = (repo_root / "config.yaml").read_text()
    path.write_text(text.replace("  dtype: float32", "  dtype: float32\n  colour: blue"))
    assert main(["demo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("hicache: error: ")
    assert "model.colour" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_device_this_machine_lacks_is_named_with_the_way_out(
        default_dict: dict[str, object]) -> None:
    """Without CUDA, ``--device cuda`` (or ``cuda:1``) is refused up front naming the
    option and ``--device cpu``, which is accepted; a config whose pool is on a CUDA device
    is refused naming its key, unless ``--device cpu`` overrides it."""
    on_cpu = config_from_dict(default_dict)
    for option in ("cuda", "cuda:1"):
        with pytest.raises(UsageError, match=rf"^--device {option}: CUDA is not available "
                                             rf"on this machine; use --device cpu$"):
            check_device(option, on_cpu)
    check_device("cpu", on_cpu)
    check_device(None, on_cpu)
    on_gpu = config_from_dict({**default_dict, "device_pool": {
        **default_dict["device_pool"], "device": "cuda"}})  # type: ignore[dict-item]
    with pytest.raises(UsageError, match=r"^device_pool.device = 'cuda': CUDA is not "
                                         r"available on this machine; pass --device cpu or "
                                         r"set device_pool.device: cpu$"):
        check_device(None, on_gpu)
    check_device("cpu", on_gpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_index_past_the_machines_devices_is_named() -> None:
    """``cuda:N`` for the last device is fine, for one past it the count is named."""
    count = torch.cuda.device_count()
    assert missing_device("cuda") is None and missing_device(f"cuda:{count - 1}") is None
    assert missing_device(f"cuda:{count}") == (
        f"this machine has {count} CUDA device{'s' if count != 1 else ''} "
        f"(cuda:0 to cuda:{count - 1})")


def test_bad_device_is_a_usage_error(repo_root: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """--device that names no device: exit 2 and one line naming the option and the value
    (checked up front, before the config's device is replaced)."""
    monkeypatch.chdir(repo_root)
    assert main(["demo", "--device", "gpu0"]) == 2
    err = capsys.readouterr().err
    assert err == "hicache: error: --device gpu0: not a device; use cpu, cuda or cuda:N\n"


def test_demo_help_explains_options(capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --help`` exits 0 and documents every option."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--config", "--device", "--seed", "--conversations", "--turns", "--quick",
                   "--json", "--corrupt-host-byte", "--write-policy"):
        assert option in out
    assert "baseline" in out
