"""hicache bench fleet: two instances sharing a file store reach the trace's ideal where the
same instances without it do not, every reused row checks out, and wrong bytes fail the run.

The hand-made trace has 5 conversations of 12 turns, turn by turn, so with round-robin over
two instances each turn lands on the other instance than the one before it: turn k needs
the block turn k-1 computed elsewhere. Every conversation starts with one shared block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hicache.bench import fleet
from hicache.bench.fleet import FleetError, FleetRow, replay_fleet
from hicache.bench.fleet_cli import main
from hicache.bench.redis_local import have_redis
from hicache.bench.trace import BLOCK, TraceRequest, lru_hit_rate, read_trace
from hicache.service import HiCacheService

CONVERSATIONS, TURNS = 5, 12
# Every turn after the first misses the previous turn's block without the store, and the
# first request of instance 1 misses the shared block.
LOST_WITHOUT_STORE = (CONVERSATIONS * (TURNS - 1) + 1) * BLOCK


def conversation_trace() -> list[dict[str, object]]:
    records = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            blocks = [0] + [1000 * (c + 1) + j for j in range(turn + 1)]
            records.append({"timestamp": len(records), "input_length": len(blocks) * BLOCK,
                            "output_length": 1, "hash_ids": blocks})
    return records


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in conversation_trace()),
                    encoding="utf-8")
    return path


def run(requests: list[TraceRequest], store: Path | None) -> FleetRow:
    row = FleetRow(2, "file" if store else "none", 128, 128,
                   ideal_hit_rate=lru_hit_rate(requests, 1 << 30))
    return replay_fleet(requests, row, None if store is None else str(store))


def test_the_shared_store_recovers_what_round_robin_loses(trace: Path, tmp_path: Path
                                                          ) -> None:
    """With the store: the ideal exactly, the lost blocks from L3, every L3 row verified;
    without it: the same device hits and nothing else."""
    requests = read_trace(trace, 60)
    shared, alone = run(requests, tmp_path / "l3"), run(requests, None)
    assert shared.hit_rate == pytest.approx(shared.ideal_hit_rate)
    assert shared.l3_hit_tokens == shared.verified_l3_tokens == LOST_WITHOUT_STORE
    assert shared.device_hit_tokens + shared.host_hit_tokens \
        == alone.device_hit_tokens + alone.host_hit_tokens
    assert alone.l3_hit_tokens == 0 and alone.hit_rate < shared.hit_rate
    assert shared.prefetch_tokens["used"] == LOST_WITHOUT_STORE
    assert shared.l3_bytes_read >= LOST_WITHOUT_STORE * 16  # 16 bytes of rows per token
    assert shared.verified_requests == 59  # all but the first, which reuses nothing


def test_wrong_bytes_from_the_store_fail_the_run(trace: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Instance 0 writes rows that are not its tokens': instance 1's first request, which
    loads instance 0's shared block from the store, fails the replay."""
    write = fleet._write_rows
    first: list[HiCacheService] = []

    def skewed(service: HiCacheService, slots: torch.Tensor, rows: torch.Tensor) -> None:
        first.append(first[0] if first else service)
        write(service, slots, rows + 1 if service is first[0] else rows)

    monkeypatch.setattr(fleet, "_write_rows", skewed)
    with pytest.raises(FleetError, match="request 1 on instance 1: the rows reused at token 0"):
        run(read_trace(trace, 60), tmp_path / "l3")


def test_command_prints_both_fleets_and_writes_json(trace: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`hicache bench fleet`: a row with the file store and one without, in the table and
    the JSON."""
    out = tmp_path / "fleet.json"
    assert main(["--trace", str(trace), "--instances", "2", "--capacities", "128:128",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "60 requests round-robin" in printed and " file " in printed
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert [(r["instances"], r["storage"]) for r in saved] == [(2, "file"), (2, "none")]
    assert saved[0]["share_of_ideal"] == pytest.approx(1.0)


@pytest.mark.skipif(not have_redis(), reason="redis-server not installed")
def test_command_runs_on_a_local_redis(trace: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    """--storage redis: a loopback server holds the shared pages; the same hits as a file."""
    assert main(["--trace", str(trace), "--instances", "2", "--capacities", "128:128",
                 "--storage", "redis", "--trace-requests", "30"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if " redis " in x)
    assert "100.0%" in line  # of the ideal


def test_bad_capacities_are_a_usage_error(trace: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    """A host smaller than the device: exit 2, one line naming the option."""
    assert main(["--trace", str(trace), "--capacities", "8:4"]) == 2
    assert "--capacities" in capsys.readouterr().err


def test_storage_is_checked_and_made_absolute(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory named like a scheme stays a directory; a file URL becomes its path; a file
    in the way or another scheme is a usage error naming ``--storage``."""
    from hicache.bench.fleet_cli import _check_storage
    from hicache.cli.parser import UsageError

    monkeypatch.chdir(tmp_path)
    assert _check_storage("redis-pages") == str(tmp_path / "redis-pages")
    assert _check_storage(f"file://{tmp_path}/l3") == str(tmp_path / "l3")
    (tmp_path / "f").write_text("x")
    for bad in ("f", "http://x", "f/sub"):
        with pytest.raises(UsageError, match=f"--storage {bad}"):
            _check_storage(bad)


def test_a_device_smaller_than_a_request_is_a_usage_error(
        trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The longest request (13 blocks) must fit one instance's device: exit 2 up front."""
    assert main(["--trace", str(trace), "--capacities", "4:8"]) == 2
    assert "device >= 13" in capsys.readouterr().err
