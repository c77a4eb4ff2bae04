"""A new user's first commands: the built-in config, ``hicache init``, ``--version``, and the
one-line errors for bad arguments and unwritable output paths (checked before any work)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import hicache
from hicache.cli import main
from hicache.cli.app import build_parser
from hicache.cli.parser import integer
from hicache.config import default_config_text, load_config, load_default_config


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from an empty directory outside the checkout."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_check_config_without_path_uses_the_built_in_default(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check-config with no PATH validates the packaged default from any directory."""
    assert main(["check-config"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("built-in default: 4 layers (sliding-window 1, 3, window 64 ")
    assert out[-2].endswith(": fits")
    assert out[-1] == "storage (L3): none"


def test_built_in_default_is_the_repository_config(repo_root: Path) -> None:
    """The packaged default and the repository's config.yaml are the same file's text."""
    assert default_config_text() == (repo_root / "config.yaml").read_text(encoding="utf-8")
    assert load_default_config() == load_config(repo_root / "config.yaml")


def test_init_writes_a_commented_loadable_copy(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """init writes config.yaml, with comments, that check-config accepts."""
    assert main(["init"]) == 0
    written = (elsewhere / "config.yaml").read_text(encoding="utf-8")
    assert written == default_config_text() and written.count("\n#") >= 5
    assert capsys.readouterr().out == ("wrote config.yaml; edit it, check it with 'hicache "
                                       "check-config config.yaml' and run 'hicache demo "
                                       "--config config.yaml'\n")
    assert main(["check-config", "config.yaml"]) == 0


def test_init_keeps_an_existing_file(elsewhere: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """init refuses to overwrite a file (exit 2, one line) unless --force."""
    path = elsewhere / "mine.yaml"
    path.write_text("page_size_tokens: 8\n")
    assert main(["init", "mine.yaml"]) == 2
    assert capsys.readouterr().err == ("hicache: error: mine.yaml: already exists; keep it, "
                                       "name another PATH, or pass --force to overwrite it\n")
    assert path.read_text() == "page_size_tokens: 8\n"
    assert main(["init", "--force", "mine.yaml"]) == 0
    assert yaml.safe_load(path.read_text())["page_size_tokens"] == 16


def test_init_into_a_missing_directory_is_one_line(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """init to a path whose directory does not exist: exit 2, one line, nothing created."""
    assert main(["init", "no/such/dir/config.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == ("hicache: error: PATH no/such/dir/config.yaml: cannot write a file there "
                   "(No such file or directory); name a file in an existing directory you "
                   "can write to\n")
    assert list(elsewhere.iterdir()) == []


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints the package version and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"hicache {hicache.__version__}\n"


def test_a_whole_number_option_takes_both_its_bounds() -> None:
    """``integer(minimum, maximum)`` accepts each bound itself and refuses one past it."""
    turns = integer(1, 1000)
    assert (turns("1"), turns("1000")) == (1, 1000)
    for text, message in (("0", "expected a whole number >= 1, got 0"),
                          ("1001", "expected a whole number <= 1000, got 1001"),
                          ("1.5", "expected a whole number >= 1, got '1.5'")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"^{message}$"):
            turns(text)
    assert integer()("-7") == -7  # no bounds


@pytest.mark.parametrize(("argv", "expected"), [
    (["demo", "--turns", "x"],
     "hicache demo: error: argument --turns: expected a whole number >= 1, got 'x'; "
     "see 'hicache demo --help'\n"),
    (["demo", "--conversations", "0"],
     "hicache demo: error: argument --conversations: expected a whole number >= 1, got 0; "
     "see 'hicache demo --help'\n"),
    (["demo", "--seed", "-3"],
     "hicache demo: error: argument --seed: expected a whole number >= 0, got -3; "
     "see 'hicache demo --help'\n"),
    (["demo", "--turns", "1001"],
     "hicache demo: error: argument --turns: expected a whole number <= 1000, got 1001; "
     "see 'hicache demo --help'\n"),
    (["demo", "--write-policy", "often"],
     "hicache demo: error: argument --write-policy: invalid choice: 'often' (choose from "
     "write_through, write_through_selective, write_back, config); "
     "see 'hicache demo --help'\n"),
    (["dmeo"], None),
])
def test_argument_errors_are_one_line(
    argv: list[str], expected: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad argument exits 2 with one line that names the option and points to --help."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache")
    if expected is not None:
        assert err.replace("'write_through'", "write_through") \
            .replace("'write_through_selective'", "write_through_selective") \
            .replace("'write_back'", "write_back").replace("'config'", "config") == expected


def test_no_argument_type_is_named_after_a_function() -> None:
    """Every option's type reports its own message: none falls back to argparse's
    ``invalid <function name> value``, except int and float, whose names read as words."""

    def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
        found = list(parser._actions)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found += actions(sub)
        return found

    for action in actions(build_parser()):
        kind = action.type
        if kind is None or kind in (int, float, str, Path):
            continue
        with pytest.raises(argparse.ArgumentTypeError):
            kind("not-a-value")  # type: ignore[operator]


@pytest.mark.parametrize("option", ["--json"])
def test_demo_checks_its_output_before_running(
    option: str, elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unwritable --json fails at once (exit 2, one line), before the demo runs."""
    (elsewhere / "a_file").write_text("")
    for path, reason in (("missing/report.json", "No such file or directory"),
                         ("a_file/report.json", "Not a directory")):
        assert main(["demo", "--quick", option, path]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (f"hicache: error: {option} {path}: cannot write a file there "
                                f"({reason}); name a file in an existing directory you can "
                                f"write to\n")
    assert main(["demo", "--quick", option, "."]) == 2
    assert capsys.readouterr().err == f"hicache: error: {option} .: is a directory; name a " \
                                      f"file to write\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_demo_refuses_a_read_only_directory(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --json in a directory without write permission: exit 2, one line."""
    locked = elsewhere / "locked"
    locked.mkdir(mode=0o555)
    assert main(["demo", "--json", str(locked / "r.json")]) == 2
    assert "(Permission denied)" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--from-json", "{saved}", "--plot", "missing/chart.png"],
    ["--from-json", "{saved}", "--auto-table", "missing/table.json"],
    ["--quick", "--json", "missing/result.json"],
    ["scheduler", "--quick", "--json", "missing/figures.json"],
])
def test_bench_checks_its_outputs_before_running(
    argv: list[str], repo_root: Path, elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench's --plot, --auto-table and --json are checked before anything is measured or
    rendered: exit 2 and one line naming the option, nothing on stdout."""
    saved = str(repo_root / "docs" / "bench-h100.json")
    argv = [arg.format(saved=saved) for arg in argv]
    assert main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    option = argv[-2]
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert f"error: {option} missing/" in captured.err
    assert "cannot write a file there (No such file or directory)" in captured.err


def test_bench_scheduler_checks_its_trace_before_running(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --trace that cannot be read: exit 2 and one line, before anything is measured."""
    assert main(["bench", "scheduler", "--trace", "absent.jsonl"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("hicache bench scheduler: error: --trace absent.jsonl: cannot read "
                            "it (No such file or directory); name a JSONL trace file\n")


def test_errors_are_one_line_from_the_console(elsewhere: Path) -> None:
    """Through a real process: a bad --json and a missing config each give exit 2 and
    exactly one line on stderr, no traceback."""
    for argv in (["demo", "--json", "missing/r.json"], ["check-config", "absent.yaml"],
                 ["demo", "--turns", "x"]):
        result = subprocess.run([sys.executable, "-m", "hicache.cli", *argv],
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 2, argv
        assert result.stdout == ""
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, argv
