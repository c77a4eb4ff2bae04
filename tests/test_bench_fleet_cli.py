"""``hicache bench fleet``'s command line: the documented defaults, what each replay is asked
for (fleet sizes, stores, settling, verification, a fresh namespace, clearing a Redis
store), the checks made before anything runs, the exit code of a failed run, and the table's
columns lined up. Replays are real except where a recorder stands in to see the arguments."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.bench import fleet
from hicache.bench.fleet import FleetRow
from hicache.bench.fleet_cli import add_arguments, main, render
from hicache.bench.trace import BLOCK
from hicache.service import HiCacheService


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """Four requests: a block, the same and one more, again, and a new one."""
    path = tmp_path / "trace.jsonl"
    records = [[1], [1, 2], [1, 2, 3], [9]]
    path.write_text("".join(json.dumps({"input_length": len(blocks) * BLOCK,
                                        "hash_ids": blocks}) + "\n" for blocks in records),
                    encoding="utf-8")
    return path


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every replay, which then runs for real."""
    calls: list[dict[str, Any]] = []
    replay = fleet.replay_fleet

    def recorded(requests: Any, row: FleetRow, storage: str | None, **options: Any
                 ) -> FleetRow:
        calls.append({"instances": row.instances, "store": row.storage, "where": storage,
                      "capacities": (row.device_blocks, row.host_blocks),
                      "ideal": row.ideal_hit_rate, "requests": len(requests), **options})
        return replay(requests, row, storage, **options)

    monkeypatch.setattr(fleet, "replay_fleet", recorded)
    return calls


def test_the_defaults_are_the_documented_ones() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--trace", "t.jsonl"])
    assert (args.trace_requests, args.instances, args.capacities, args.storage,
            args.prefetch_policy, args.verify_every, args.no_settle, args.json) == (
        2000, [2, 4], ["2000:8000"], "file", "wait_complete", 1, False, None)


def test_a_trace_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main([])
    assert stop.value.code == 2 and "--trace" in capsys.readouterr().err


def test_each_fleet_runs_with_the_shared_store_then_without(
        trace: Path, replays: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
        ) -> None:
    """Per fleet size, a run on its own fresh directory of the file store, then one
    without a store; each settles, verifies every request, keeps the file store's pages,
    has a namespace of its own, and the ideal is the trace's (an unlimited block LRU)."""
    assert main(["--trace", str(trace), "--instances", "1", "2", "--capacities", "4:4"]) == 0
    assert [(c["instances"], c["store"]) for c in replays] == [
        (1, "file"), (1, "none"), (2, "file"), (2, "none")]
    assert all(c["settle_backups"] and c["verify_every"] == 1 and not c["clear_store"]
               and c["prefetch_policy"] == "wait_complete" and c["requests"] == 4
               and c["capacities"] == (4, 4) for c in replays)
    assert [c["where"] is None for c in replays] == [False, True, False, True]
    assert replays[0]["where"] != replays[2]["where"]
    assert len({c["model_revision"] for c in replays}) == 4
    assert {c["ideal"] for c in replays} == {3 / 7}  # 3 of the 7 blocks asked for hit
    printed = capsys.readouterr().out
    assert "4 requests round-robin, 512-token pages, prefetch wait_complete\n" in printed


def test_options_reach_every_replay(trace: Path, tmp_path: Path,
                                    replays: list[dict[str, Any]],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """--no-settle, --verify-every 0, one request, one instance, a store directory whose
    parents do not exist yet: each replay gets them (and the header says no settle)."""
    store = tmp_path / "a" / "b"
    assert main(["--trace", str(trace), "--instances", "1", "--capacities", "4:4",
                 "--trace-requests", "1", "--verify-every", "0", "--no-settle",
                 "--prefetch-policy", "best_effort", "--storage", str(store)]) == 0
    assert [(c["settle_backups"], c["verify_every"], c["requests"], c["prefetch_policy"])
            for c in replays] == [(False, 0, 1, "best_effort")] * 2
    assert Path(replays[0]["where"]).parent == store
    assert ", no settle" in capsys.readouterr().out


def test_a_host_smaller_than_the_device_is_refused(
        trace: Path, replays: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
        ) -> None:
    """The device holds the longest request here, so only the host's size is wrong."""
    assert main(["--trace", str(trace), "--capacities", "8:4"]) == 2
    assert "--capacities" in capsys.readouterr().err and replays == []


def test_an_unreachable_redis_url_stops_before_the_run(
        trace: Path, replays: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
        ) -> None:
    """A Redis URL nothing answers at: exit 1 naming it, nothing replayed."""
    assert main(["--trace", str(trace), "--storage", "redis://127.0.0.1:1",
                 "--capacities", "4:4"]) == 1
    err = capsys.readouterr().err
    assert "--storage redis://127.0.0.1:1" in err and "start it" in err and replays == []


def test_wrong_bytes_fail_the_command(trace: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Rows that are not the tokens': exit 1 and a line that says the run FAILED."""
    write = fleet._write_rows

    def skewed(service: HiCacheService, slots: torch.Tensor, rows: torch.Tensor) -> None:
        write(service, slots, rows + 1)

    monkeypatch.setattr(fleet, "_write_rows", skewed)
    assert main(["--trace", str(trace), "--instances", "1", "--capacities", "4:4"]) == 1
    assert "hicache bench fleet: FAILED: request 1 on instance 0" in capsys.readouterr().err


def test_the_table_lines_up() -> None:
    rows = [FleetRow(2, "file", 2000, 8000, requests=10, input_tokens=1000,
                     device_hit_tokens=500, host_hit_tokens=100, l3_hit_tokens=50,
                     seconds=2.0, ideal_hit_rate=0.8, l3_bytes_written=3 << 20,
                     l3_bytes_read=1 << 20, verified_requests=9),
            FleetRow(4, "none", 20, 80)]
    header, rule, *lines, footer = render(rows).splitlines()
    assert set(rule) == {"-"} and len(rule) == len(header)
    assert all(len(line) == len(header) for line in lines)
    assert lines[0].split() == ["2", "file", "2000:8000", "65.0%", "50.0%", "10.0%", "5.0%",
                                "80.0%", "81.2%", "5.0", "3.0", "1.0", "9"]
    assert lines[1].split()[3:7] == ["0.0%"] * 4  # no input: no division by zero
    assert footer.startswith("(device:host")
