"""``hicache bench ranks``: a real run on two spawned ranks in a gloo group (few steps), its
table and JSON, and the refused arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import main

CASES = [
    "reference: all-gather of 8 int64", "reference: all-reduce min, 8",
    "step idle, alone", "step idle, alone, store", "step idle, rank of a group",
    "step idle, rank of a group, store",
    "step busy, alone", "request + step busy, alone",
    "step busy, alone, store", "request + step busy, alone, store",
    "step busy, rank of a group", "request + step busy, rank of a group",
    "step busy, rank of a group, store", "request + step busy, rank of a group, store",
    "step busy, rank of a group, MLA, own store",
    "request + step busy, rank of a group, MLA, own store",
    "step busy, rank of a group, MLA, shared store",
    "request + step busy, rank of a group, MLA, shared store",
]


def test_a_run_times_every_case_on_every_rank(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ranks.json"
    assert main(["bench", "ranks", "--steps", "12", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 ranks, 12 steps a case" in printed
    for case in CASES:
        assert case in printed
    saved = json.loads(out.read_text())
    assert (saved["ranks"], saved["steps"]) == (2, 12)
    assert [row["case"] for row in saved["rows"]] == CASES
    for row in saved["rows"]:
        assert len(row["median_us"]) == len(row["p99_us"]) == 2
        assert all(0 < median <= p99 for median, p99 in zip(row["median_us"], row["p99_us"],
                                                            strict=True))


@pytest.mark.parametrize(("args", "message"), [
    (["--ranks", "1"], "--ranks 1: a group needs at least 2 ranks"),
    (["--steps", "9"], "--steps 9: time at least 10 steps a case"),
])
def test_bad_arguments_are_refused_before_anything_runs(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "ranks", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_json_path_that_is_a_directory_is_refused(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "ranks", "--json", str(tmp_path)]) == 2
    assert "--json" in capsys.readouterr().err
