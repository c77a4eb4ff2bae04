"""A new user's install: a wheel built from the sources, installed in a fresh virtual
environment (torch first, as the README says), used from a directory outside the checkout.

Slow (a fresh environment installs torch), so marked ``slow``; CI runs it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hicache

TORCH = "torch==2.13.0"  # the README's pin
IGNORED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                 ".*_cache", ".hypothesis")


def run(argv: list[str | Path], cwd: Path, timeout_s: float = 600) -> str:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"}
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run([str(arg) for arg in argv], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout_s, check=False)
    assert result.returncode == 0, f"{argv}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def build_wheel(repo_root: Path, tmp_path: Path) -> Path:
    """A wheel built from a copy of the sources (the checkout gets no build folder)."""
    source = tmp_path / "source"
    shutil.copytree(repo_root, source, symlinks=True, ignore=IGNORED)
    command: list[str | Path] = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                                 "-w", tmp_path / "dist", source]
    if importlib.util.find_spec("setuptools") is not None:
        command.insert(4, "--no-build-isolation")  # no download of the build backend
    run(command, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("hicache-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_works_in_a_fresh_environment(repo_root: Path, tmp_path: Path) -> None:
    """From a fresh venv and the wheel, outside the checkout: --version, init, check-config
    (built-in and written), demo --quick all work, and hicache is the installed copy."""
    wheel = build_wheel(repo_root, tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "hicache/config/default.yaml" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") or name.endswith("/LICENSE")
               for name in names), names

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    python, hicache_bin = venv / "bin" / "python", venv / "bin" / "hicache"
    run([python, "-m", "pip", "install", "-q", TORCH], cwd=tmp_path)
    run([python, "-m", "pip", "install", "-q", wheel], cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    location = run([python, "-c", "import hicache; print(hicache.__file__)"], cwd=elsewhere)
    assert Path(location.strip()).is_relative_to(venv)
    assert run([hicache_bin, "--version"], cwd=elsewhere) == f"hicache {hicache.__version__}\n"
    assert run([hicache_bin, "check-config"], cwd=elsewhere).startswith("built-in default: ")
    assert run([hicache_bin, "init"], cwd=elsewhere).startswith("wrote config.yaml")
    assert run([hicache_bin, "check-config", "config.yaml"],
               cwd=elsewhere).startswith("config.yaml: ")
    out = run([hicache_bin, "demo", "--quick", "--config", "config.yaml"], cwd=elsewhere)
    assert out.rstrip().endswith("result             PASS")
    out = run([hicache_bin, "demo", "--quick"], cwd=elsewhere)
    assert "(config built-in default, seed 0" in out and "result             PASS" in out
