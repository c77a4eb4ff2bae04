"""Bench commands' arguments, refused before any work and without a traceback:

- ``hicache bench scheduler --sizes`` too large for this machine's RAM ran the sizes before
  it in full, then failed naming ``device_pool.num_tokens``, a key the user never wrote.
- ``python -m hicache.bench.checks`` (a README command) took ``--repeats 0`` (a
  ``ZeroDivisionError`` traceback), negative counts, and any ``--device`` text.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hicache.bench.checks import main as checks_main
from hicache.cli import main


def test_bench_scheduler_refuses_sizes_beyond_ram_naming_the_option(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "scheduler", "--sizes", "10000", str(10**13), "--repeats", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--sizes {10**13}: the pools of a tree that size do not fit" in err, err
    assert "tree of" not in err, err  # nothing measured first


@pytest.mark.parametrize(("argv", "said"), [
    (["--repeats", "0"], "--repeats: expected a whole number >= 1, got 0"),
    (["--tokens", "-4"], "--tokens: expected a whole number >= 1, got -4"),
    (["--batch", "x"], "--batch: expected a whole number >= 1, got 'x'"),
    (["--device", "foo"], "--device foo: not a device"),
])
def test_bench_checks_refuses_bad_arguments(argv: list[str], said: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        checks_main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_bench_checks_zero_repeats_as_a_command() -> None:
    done = subprocess.run([sys.executable, "-m", "hicache.bench.checks", "--repeats", "0",
                           "--device", "cpu"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-400:]
