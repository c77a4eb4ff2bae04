"""``hicache demo`` from the command line: exit codes and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.cli import main


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
