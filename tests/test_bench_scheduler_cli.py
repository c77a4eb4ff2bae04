"""``hicache bench scheduler``'s command line: the documented defaults, what each measuring
function is asked for (sizes, repeats, seeds), the checks made before anything is measured,
and the table's columns lined up. The measuring functions are replaced by recorders here
(they are tested in tests/test_bench_scheduler*.py); the run, its parsing, checks, table
and JSON are the real ones."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

import hicache.bench.scheduler as scheduler_module
import hicache.bench.scheduler_ops as ops_module
import hicache.bench.scheduler_requests as requests_module
import hicache.bench.scheduler_thread as thread_module
from hicache.bench.scheduler import Figure
from hicache.bench.scheduler_cli import add_arguments, main, render
from hicache.bench.scheduler_requests import BATCH, RequestsRow


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """What the run asks of each measuring function, in order; each answers one figure of
    its own (two values) and the end-to-end row a row of that size."""
    calls: list[tuple[Any, ...]] = []

    def figure(name: str) -> Any:
        def measure(*args: Any) -> dict[str, list[float]]:
            calls.append((name, *args))
            return {name: [1.0, 3.0]}
        return measure

    def requests(size: int, count: int, seed: int, per_step: int = 1) -> RequestsRow:
        calls.append(("requests", size, count, seed, per_step))
        return RequestsRow(size, count, count * 2048, count * 1024, 0.5, per_step)

    monkeypatch.setattr(scheduler_module, "measure_tree", figure("tree"))
    monkeypatch.setattr(requests_module, "measure_requests", requests)
    monkeypatch.setattr(thread_module, "measure_thread_latency", figure("thread"))
    monkeypatch.setattr(ops_module, "measure_allocator", figure("allocator"))
    monkeypatch.setattr(ops_module, "measure_controller", figure("controller"))
    return calls


def test_the_defaults_are_the_documented_ones(asked: list[tuple[Any, ...]],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Trees of 10k, 100k and 1M tokens, 200 repeats, seed 0: per tree its figures and two
    end-to-end rows of 1,000 requests (one a step, ``BATCH`` a step); the thread figure at
    the largest tree with 2,000 calls a side; the pools' and controller's figures."""
    assert main([]) == 0
    sizes = (10_000, 100_000, 1_000_000)
    expected: list[tuple[Any, ...]] = []
    for size in sizes:
        expected += [("tree", size, 200, 0), ("requests", size, 1000, 0, 1),
                     ("requests", size, 1000, 0, BATCH)]
    expected += [("thread", 1_000_000, 2000, 0), ("allocator", 200), ("controller", 200)]
    assert asked == expected
    printed = capsys.readouterr().out
    assert "medians of 200 calls" in printed and "no replay" not in printed


def test_the_replay_defaults_to_the_documented_requests_and_capacities() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.trace, args.trace_requests, args.capacities) == (
        None, 1000, ["5000:5000", "5000:20000", "20000:20000"])


def test_quick_is_two_trees_and_at_most_30_repeats(asked: list[tuple[Any, ...]]) -> None:
    assert main(["--quick", "--seed", "4"]) == 0
    assert [call for call in asked if call[0] == "tree"] == [
        ("tree", 10_000, 30, 4), ("tree", 100_000, 30, 4)]
    asked.clear()
    assert main(["--quick", "--repeats", "7"]) == 0
    assert asked[0] == ("tree", 10_000, 7, 0)


def test_the_smallest_counts_are_accepted_and_zero_refused(
        asked: list[tuple[Any, ...]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--repeats 1``, ``--trace-requests 1`` and a tree of 1,000 tokens run; 0 repeats, 0
    trace requests and a tree of 999 tokens stop before anything is measured (exit 2)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_length": 512, "hash_ids": [1]}\n' * 3, encoding="utf-8")
    assert main(["--sizes", "1000", "--repeats", "1", "--trace", str(trace),
                 "--trace-requests", "1", "--capacities", "4:4", "8:2"]) == 0
    printed = capsys.readouterr().out  # a host smaller than the device is a replay too
    assert "replay of trace.jsonl: 1 requests" in printed and "       8:2 " in printed
    asked.clear()
    for bad in (["--repeats", "0"], ["--trace", str(trace), "--trace-requests", "0"],
                ["--sizes", "999"]):
        assert main(["--sizes", "1000", *bad] if bad[0] != "--sizes" else bad) == 2
        assert bad[0] in capsys.readouterr().err
    assert asked == []


def test_a_json_path_that_cannot_be_written_stops_before_measuring(
        asked: list[tuple[Any, ...]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", str(tmp_path / "missing" / "out.json")]) == 2
    assert "--json" in capsys.readouterr().err and asked == []
    out = tmp_path / "out.json"
    assert main(["--sizes", "1000", "--repeats", "1", "--json", str(out)]) == 0
    saved = json.loads(out.read_text(encoding="utf-8"))
    by_name = {figure["name"]: figure["by_size"] for figure in saved["figures"]}
    # the pools' and controller's figures belong to no tree: size 0 ("-" in the table)
    assert by_name["allocator"] == by_name["controller"] == {"0": [1.0, 3.0]}
    assert by_name["tree"] == {"1000": [1.0, 3.0]}


def test_the_table_lines_up_for_short_and_long_names() -> None:
    short = Figure("poll", 5.0, {0: [1.0, 2.0, 3.0]})
    long = Figure("a figure whose name is longer than the first column's width",
                  None, {1000: [1.0, 2.0, 4.0], 10_000: [2.0, 4.0, 8.0]})
    for figures in ([short], [short, long]):
        lines = render(figures, [1000, 10_000]).splitlines()
        header, rule, *rows, footer = lines
        assert set(rule) == {"-"} and len(rule) == len(header)
        assert all(len(row) == len(header) for row in rows), rows
        assert footer.startswith("(microseconds")
    assert len(render([short], [0]).splitlines()[1]) == 42 + 59  # names padded to 42
    poll = render([short], [1000]).splitlines()[2].split()
    assert poll == ["poll", "-", "1.0", "2.0", "3.0", "5"]
    rows = render([long], [1000, 10_000]).splitlines()[2:4]
    assert [row.split()[-6:] for row in rows] == [  # the slope on every row of the figure
        ["1000", "1.0", "2.0", "4.0", "-", "0.30"], ["10000", "2.0", "4.0", "8.0", "-", "0.30"]]
