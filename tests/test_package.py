"""The top-level package: the names an engine imports, loaded on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import hicache


def test_import_loads_no_heavy_dependency() -> None:
    """``import hicache`` imports neither torch, Triton nor the Prometheus client."""
    heavy = "('torch', 'triton', 'prometheus_client')"
    code = f"import sys, hicache; print(sorted(m for m in {heavy} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"


@pytest.mark.parametrize("name", hicache.__all__)
def test_public_name_is_its_modules_object(name: str) -> None:
    """Each public name is the object of the module that defines it."""
    source = hicache._SOURCES[name]
    assert getattr(hicache, name) is getattr(importlib.import_module(source), name)


def test_unknown_name_raises_attribute_error() -> None:
    """A name outside the public API is an AttributeError, not a lazy import."""
    with pytest.raises(AttributeError, match="no attribute 'radix_tree'"):
        _ = hicache.radix_tree


def test_bench_module_entry_point(repo_root: Path) -> None:
    """``python -m hicache.bench --from-json`` re-renders a saved result and exits 0."""
    result = subprocess.run(
        [sys.executable, "-m", "hicache.bench", "--from-json", "docs/bench-h100.json"],
        cwd=repo_root, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("NVIDIA H100")


MAX_MODULE_LINES = 300  # issue 11: modules small enough to read in one sitting


def test_every_module_is_at_most_300_lines(repo_root: Path) -> None:
    """Every module of the package (hicache/, pools/, controller/, metrics/) has at most
    ``MAX_MODULE_LINES`` lines: a module that grows past it is split by noun."""
    modules = [path for folder in ("hicache", "pools", "controller", "metrics")
               for path in (repo_root / folder).rglob("*.py")]
    assert len(modules) > 100, "the package's modules were not found"
    long = {str(path.relative_to(repo_root)): lines for path in modules
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
