"""`hicache bench storage` in a plain `pip install hicache` environment (no `hicache[redis]`),
found by a packaging audit.

The default `--stores` is `file redis cluster`; the Redis rows compare hicache's store with
redis-py + hiredis, an optional dependency (`hicache[redis]`). The command's `_check` verifies
redis-server before any work, but never that redis-py is importable: a new user's run
measures the file store (and hicache's side of Redis), then dies with a
`ModuleNotFoundError` traceback, against the CLI contract (errors are one line,
`... error: ...`, exit code 2, checked before any work starts).

A second face of the same gap: with redis-py but without hiredis (`pip install redis`),
the reference is redis-py's pure-Python parser, yet every row is labelled
"redis-py + hiredis" and the ratio is computed against it.

The missing module is simulated with `sys.modules[name] = None` in a child process, which
is what Python does for a module that is not installed (ModuleNotFoundError on import).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None
                                or shutil.which("redis-cli") is None,
                                reason="needs redis-server (the command starts one)")

ARGS = ["bench", "storage", "--quick", "--stores", "redis", "--page-tokens", "2",
        "--batch-mib", "1", "--repeats", "1", "--turns", "1"]


def run_without(module: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from hicache.cli import main\n"
            "raise SystemExit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *ARGS], cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False)


def test_without_redis_py_is_a_one_line_usage_error_before_any_work(tmp_path: Path) -> None:
    result = run_without("redis", tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "hicache[redis]" in result.stderr, result.stderr
    # checked before the run: no store was measured
    assert "KiB pages x" not in result.stderr, result.stderr


def test_without_hiredis_the_reference_is_not_labelled_hiredis(tmp_path: Path) -> None:
    result = run_without("hiredis", tmp_path)
    if result.returncode == 2:  # refused up front, naming hiredis: also a fix
        assert "hiredis" in result.stderr and "Traceback" not in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert "redis-py + hiredis" not in result.stdout, result.stdout
