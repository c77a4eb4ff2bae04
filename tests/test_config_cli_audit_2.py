"""Audit of bad input on the ``hicache`` command line: every subcommand (``check-config``,
``init``, ``demo``, ``bench`` and its ``scheduler``, ``storage``, ``fleet``, ``e2e``).

The contract (``hicache/cli/app.py``): a mistake the user can fix exits 2 with one line on
stderr that names the option (or the config key) and the value, before any work starts;
nothing is left behind (no output file, no directory, no thread). Most commands run
in-process through ``main``; a few representative ones run as real processes to check the
exit code and that no traceback reaches the console. Tests that expose a gap assert the
correct behaviour and fail until it is fixed. The config file side is in
``test_config_cli_audit.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.bench import scheduler_cli, storage_cli
from hicache.bench.redis_local import free_port
from hicache.cli import main
from hicache.config import default_config_text

TRACE = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'
TINY_DEMO = ["demo", "--quick", "--conversations", "1", "--turns", "1"]


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``hicache ARGV`` in-process: (code, stdout, stderr); no exception, no thread left."""
    before = set(threading.enumerate())
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:
        pytest.fail(f"hicache {' '.join(argv)} raised {type(exc).__name__}: {exc} "
                    f"(a traceback on the console)")
    captured = capsys.readouterr()
    deadline = time.monotonic() + 5.0
    while (left := [t for t in threading.enumerate() if t not in before and t.is_alive()]) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, f"hicache {' '.join(argv)} left threads {[t.name for t in left]}"
    return code, captured.out, captured.err


def config_file(tmp_path: Path, *edits: tuple[str, str], name: str = "config.yaml") -> Path:
    """The built-in default config with each ``(old, new)`` text replaced, in ``tmp_path``."""
    text = default_config_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from an empty directory holding a one-request trace, ``trace.jsonl``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trace.jsonl").write_text(TRACE, encoding="utf-8")
    return tmp_path


@pytest.fixture(autouse=True)
def nothing_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler benchmark that gets past its checks fails at once instead of measuring."""

    def measured(*_: object) -> None:
        """Stands in for the measurement."""
        raise AssertionError("bench scheduler started measuring before its arguments were "
                             "checked")

    monkeypatch.setattr(scheduler_cli, "_measure", measured)


# ---- option values: exit 2, one line naming the option (and the value) --------------------

OPTION_ERRORS = [
    (["bench", "--tokens", "-5"], "--tokens", "-5"),
    (["bench", "--page-sizes", "0"], "--page-sizes", None),
    (["bench", "--quick", "--window-ms", "-1"], "--window-ms", "-1"),
    (["bench", "--quick", "--max-slowdown-pct", "nan"], "--max-slowdown-pct", "nan"),
    (["bench", "--quick", "--min-share-of-best", "-3"], "--min-share-of-best", "-3"),
    (["bench", "scheduler", "--repeats", "-7"], "--repeats", "-7"),
    (["bench", "scheduler", "--capacities", "5:x"], "--capacities", None),
    (["bench", "scheduler", "--capacities", "5:5:5"], "--capacities", "5:5:5"),
    (["bench", "scheduler", "--capacities", "0:-1"], "--capacities", "0:-1"),
    (["bench", "storage", "--page-tokens", "0"], "--page-tokens", None),
    (["bench", "fleet", "--trace", "trace.jsonl", "--instances", "0"], "--instances", None),
    (["bench", "e2e", "--device", "xpu", "--tiny"], "--device", "xpu"),
    (["bench", "e2e", "--device", "cpu", "--tiny", "--tokens", "10"], "--tokens", "10"),
    (["demo", "--seed", str(2**64)], "--seed", str(2**64)),
    (["demo", "--device", "gpu0"], "--device", "gpu0"),
]


@pytest.mark.parametrize(("argv", "option", "value"), OPTION_ERRORS,
                         ids=[" ".join(a[:4]) for a, _, _ in OPTION_ERRORS])
def test_a_bad_option_value_names_the_option(argv: list[str], option: str, value: str | None,
                                             in_tmp: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2, nothing on stdout, one line on stderr with the option and the value."""
    code, out, err = cli(argv, capsys)
    assert (code, out) == (2, ""), err
    assert err.count("\n") == 1 and option in err, err
    assert value is None or value in err, err


# ---- check-config and init -----------------------------------------------------------------


def test_check_config_of_a_cuda_device_this_machine_lacks_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pools on a GPU this machine lacks: exit code not 0, naming the key (as for a store)."""
    device = f"cuda:{torch.cuda.device_count()}"
    path = config_file(tmp_path, ("device: cpu ", f"device: {device} "))
    code, _, err = cli(["check-config", str(path)], capsys)
    assert code != 0 and "device_pool.device" in err and device in err, err


def test_check_config_skip_device_check_passes_a_config_for_another_machine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--skip-device-check``: the missing GPU is not asked about, exit 0."""
    device = f"cuda:{torch.cuda.device_count()}"
    path = config_file(tmp_path, ("device: cpu ", f"device: {device} "),
                       ("io_backend: auto", "io_backend: torch"))
    assert cli(["check-config", "--skip-device-check", str(path)], capsys)[::2] == (0, "")


def test_check_config_refuses_a_cuda_backend_on_a_cpu_device(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``io_backend: staged`` with ``device: cpu`` can never run: exit 2 naming the key."""
    path = config_file(tmp_path, ("io_backend: auto", "io_backend: staged"))
    code, _, err = cli(["check-config", str(path)], capsys)
    assert code == 2 and "controller.io_backend" in err, err


def test_check_config_of_a_store_path_that_is_a_file_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """storage.path naming a regular file: the store line says so, exit 1, one stderr line."""
    (tmp_path / "pages").write_text("x")
    path = config_file(tmp_path, ("backend: none ", f"backend: file\n  path: "
                                  f"{tmp_path / 'pages'}\n "))
    code, _, err = cli(["check-config", str(path)], capsys)
    assert code == 1 and err.count("\n") == 1
    assert f"{tmp_path / 'pages'}: exists and is not a directory" in err


def test_check_config_of_a_directory_names_it(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A directory as PATH: exit 2, the path and the reason."""
    assert cli(["check-config", str(tmp_path)], capsys)[::2] == (
        2, f"hicache: error: {tmp_path}: cannot read the config file (Is a directory)\n")


def test_init_into_a_directory_names_it(in_tmp: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``hicache init DIR``: exit 2, nothing written into the directory."""
    (in_tmp / "sub").mkdir()
    code, _, err = cli(["init", "sub"], capsys)
    assert (code, err) == (2, "hicache: error: PATH sub: is a directory; name a file to "
                              "write\n")
    assert list((in_tmp / "sub").iterdir()) == []


# ---- demo ------------------------------------------------------------------------------------


def test_demo_json_onto_its_own_config_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--json`` naming the ``--config`` file: exit 2 before the run, the config kept."""
    path = config_file(tmp_path)
    code, _, err = cli([*TINY_DEMO, "--config", str(path), "--json", str(path)], capsys)
    assert path.read_text(encoding="utf-8") == default_config_text()
    assert code == 2 and "--json" in err, err


def test_demo_failure_leaves_no_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pools too small for one request: exit 1, one line, no ``--json`` file left."""
    path = config_file(tmp_path, ("num_tokens: 1024 ", "num_tokens: 64 "),
                       ("swa_num_tokens: 256", "swa_num_tokens: 64"))
    report = tmp_path / "report.json"
    code, _, err = cli([*TINY_DEMO, "--config", str(path), "--json", str(report)], capsys)
    assert code == 1 and "raise device_pool.num_tokens" in err
    assert not report.exists()


def test_demo_bad_storage_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    """``--storage http://x``: exit 2 naming ``--storage`` and the value."""
    code, _, err = cli([*TINY_DEMO, "--storage", "http://x"], capsys)
    assert code == 2 and "--storage" in err and "http://x" in err, err


def test_demo_bad_storage_url_never_prints_its_password(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed ``--storage`` URL with a password: refused, the password not shown."""
    code, _, err = cli([*TINY_DEMO, "--storage", "redis://:hunter2@127.0.0.1:99999"], capsys)
    assert code == 2 and "--storage" in err and "hunter2" not in err, err


def test_demo_with_a_redis_store_nobody_serves_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--storage`` server that does not answer: not a PASS; non-zero, naming it."""
    port = free_port()
    code, out, err = cli([*TINY_DEMO[:-1], "2", "--storage", f"redis://127.0.0.1:{port}"],
                         capsys)
    assert code != 0 and "--storage" in err and f"127.0.0.1:{port}" in err, out + err


# ---- bench -------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path, repo_root: Path) -> Path:
    """A copy of the saved H100 result, ``--from-json``'s input."""
    return Path(shutil.copy(repo_root / "docs" / "bench-h100.json", tmp_path / "run.json"))


def test_bench_auto_table_onto_its_input_is_refused(
        saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--auto-table`` naming the ``--from-json`` file: exit 2, the saved result kept."""
    before = saved.read_bytes()
    code, _, err = cli(["bench", "--from-json", str(saved), "--auto-table", str(saved)], capsys)
    assert saved.read_bytes() == before
    assert code == 2 and "--auto-table" in err, err


def test_bench_json_with_from_json_is_refused(saved: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``--json`` with ``--from-json`` writes nothing (today silently): exit 2 naming it."""
    code, _, err = cli(["bench", "--from-json", str(saved), "--json",
                        str(tmp_path / "out.json")], capsys)
    assert code == 2 and "--json" in err, err


@pytest.mark.parametrize("content", [b'{"format": 1}', b"\xff\xfe"], ids=["fields", "utf8"])
def test_bench_from_json_bad_file_names_the_file(content: bytes, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed saved result: exit 2, one line naming the file."""
    path = tmp_path / "bad-result.json"
    path.write_bytes(content)
    code, _, err = cli(["bench", "--from-json", str(path)], capsys)
    assert code == 2 and "bad-result.json" in err, err


def test_bench_scheduler_reads_its_trace_before_measuring(
        in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace that is not JSON lines: exit 2 naming ``--trace`` and the line, unmeasured."""
    (in_tmp / "bad.jsonl").write_text("not json\n")
    code, _, err = cli(["bench", "scheduler", "--trace", "bad.jsonl"], capsys)
    assert code == 2 and "--trace" in err and "line 1" in err, err


@pytest.mark.parametrize("argv", [
    ["--stores", "file", "--json", "missing/rows.json"], ["--stores", "file", "--dir",
                                                          "trace.jsonl"],
    ["--stores", "redis", "--redis", "http://x"],
], ids=["json", "dir", "redis-url"])
def test_bench_storage_checks_its_options_before_running(
        argv: list[str], in_tmp: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Bad ``--json``, ``--dir`` or ``--redis``: exit 2 naming the option, nothing measured."""
    monkeypatch.setattr(storage_cli, "_measure", lambda *_: pytest.fail("measured"))
    code, _, err = cli(["bench", "storage", "--quick", "--page-tokens", "2", *argv], capsys)
    assert code == 2 and argv[-2] in err, err


def test_bench_storage_with_a_redis_nobody_serves_is_one_line(
        in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--redis`` where nothing listens: exit code not 0, one line naming the option."""
    url = f"redis://127.0.0.1:{free_port()}"
    code, _, err = cli(["bench", "storage", "--quick", "--page-tokens", "2", "--stores",
                        "redis", "--redis", url], capsys)
    assert code != 0 and err.count("\n") == 1 and "--redis" in err, err


FLEET = ["bench", "fleet", "--trace", "trace.jsonl", "--instances", "1", "--verify-every", "0"]


def test_bench_fleet_bad_storage_names_the_option(in_tmp: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--storage http://x``: exit 2 naming ``--storage`` and the value as given."""
    code, _, err = cli([*FLEET, "--storage", "http://x"], capsys)
    assert code == 2 and "--storage http://x" in err, err


def test_bench_fleet_bad_storage_leaves_no_directory(
        in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A refused ``--storage http://x`` makes no ``http:`` directory tree."""
    cli([*FLEET, "--storage", "http://x"], capsys)
    assert sorted(p.name for p in in_tmp.iterdir()) == ["trace.jsonl"]


FLEET_INPUTS = {
    "storage-is-a-file": ("--storage", "trace.jsonl", None),
    "empty-trace": ("--trace", "empty.jsonl", ""),
    "trace-missing-keys": ("--trace", "keys.jsonl", '{"input_length": 5}\n'),
}


@pytest.mark.parametrize("case", list(FLEET_INPUTS))
def test_bench_fleet_bad_inputs_are_one_line(case: str, in_tmp: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A file as ``--storage``, an empty or keyless trace: exit 2, one line naming it."""
    option, name, text = FLEET_INPUTS[case]
    if text is not None:
        (in_tmp / name).write_text(text)
    argv = [*FLEET, "--storage", name] if option == "--storage" else [*FLEET[:3], name,
                                                                       *FLEET[4:]]
    code, _, err = cli(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and option in err, err


# ---- real processes: exit code 2, one line, no traceback ---------------------------------------


def _overflow(tmp: Path) -> list[str]:
    """check-config of ``host.ratio: 1.0e+308``."""
    return ["check-config", str(config_file(tmp, ("ratio: 4.0 ", "ratio: 1.0e+308 ")))]


def _from_dir(tmp: Path) -> list[str]:
    """bench re-rendering a directory."""
    (tmp / "results").mkdir()
    return ["bench", "--from-json", "results"]


def _garbage_trace(tmp: Path) -> list[str]:
    """bench fleet on a trace that is not JSON."""
    (tmp / "bad.jsonl").write_text("not json\n")
    return ["bench", "fleet", "--trace", "bad.jsonl", "--instances", "1"]


def _metrics_host(tmp: Path) -> list[str]:
    """demo with a metrics host that is no address of this machine."""
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: binding it fails at once
    path = config_file(tmp, ("metrics_host: 127.0.0.1 ", "metrics_host: 192.0.2.1 "))
    return [*TINY_DEMO, "--config", str(path)]


@pytest.mark.parametrize(("argv_of", "named"), [
    (_overflow, "host.ratio"), (_from_dir, "--from-json"), (_garbage_trace, "--trace"),
    (_metrics_host, "service.metrics_host"),
], ids=["host-ratio-1e308", "from-json-dir", "fleet-garbage-trace", "demo-metrics-host"])
def test_the_console_gets_one_line_and_no_traceback(
        argv_of: Callable[[Path], list[str]], named: str, tmp_path: Path) -> None:
    """Through ``python -m hicache.cli``: exit 2, one stderr line naming the key or option."""
    argv = argv_of(tmp_path)
    result = subprocess.run([sys.executable, "-m", "hicache.cli", *argv], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert named in result.stderr, result.stderr
