"""The source distribution carries the test suite whole or not at all (a packaging audit).

setuptools adds ``tests/test*.py`` to every sdist by default, but not ``tests/conftest.py``
nor the helper modules the tests import, nor ``config.yaml``: pytest on the unpacked sdist
stopped at collection. ``MANIFEST.in`` now leaves the tests out; the package, its data and
the default config are in.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IGNORED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                 ".*_cache", ".hypothesis", ".gpuprof")


@pytest.fixture(scope="module")
def sdist_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    tmp = tmp_path_factory.mktemp("sdist")
    source = tmp / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=IGNORED)
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", code, str(tmp / "dist")], cwd=source,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    (tarball,) = (tmp / "dist").glob("hicache-*.tar.gz")
    with tarfile.open(tarball) as archive:
        return {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}


def test_sdist_tests_are_whole_or_absent(sdist_names: set[str]) -> None:
    shipped_tests = sorted(n for n in sdist_names if n.startswith("tests/test_"))
    if not shipped_tests:
        return  # no tests shipped: fine
    needed = {"tests/conftest.py", "config.yaml"} | {
        f"tests/{p.name}" for p in (REPO / "tests").glob("*.py") if not p.name.startswith("test_")}
    missing = sorted(needed - sdist_names)
    assert not missing, (f"the sdist ships {len(shipped_tests)} test files but not what they "
                         f"need: {missing}")


def test_sdist_carries_the_package_and_its_data(sdist_names: set[str]) -> None:
    assert {"hicache/__init__.py", "hicache/config/default.yaml", "pools/__init__.py",
            "controller/auto_table.json", "metrics/__init__.py", "pyproject.toml",
            "README.md"} <= sdist_names
    assert not any(name.startswith("tests/") for name in sdist_names)
