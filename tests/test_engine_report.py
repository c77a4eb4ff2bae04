"""The demo's report (hicache.engine.report) on a CPU: what moved and how fast, the JSON,
and how a failed verification reads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.config import config_from_dict
from hicache.engine import DemoOptions, run_demo
from hicache.engine.report import DemoReport, TransferTimer
from hicache.factory import build_service

SMALL = DemoOptions(quick=True, conversations=5, turns=3)


REPO = Path(__file__).resolve().parent.parent


def default_data() -> dict[str, Any]:
    """config.yaml, with the metrics endpoint off (tests open no port)."""
    data: dict[str, Any] = yaml.safe_load((REPO / "config.yaml").read_text())
    data["service"]["metrics_enabled"] = False
    return data


@pytest.fixture(scope="module")
def report() -> DemoReport:
    return run_demo(config_from_dict(default_data(), check_ram=False), SMALL)


def test_each_direction_reports_its_tokens_bytes_time_and_rate(report: DemoReport) -> None:
    """On a CPU every op is timed by the wall time of its synchronous copy, so both
    directions have a rate; their tokens are the tree's backups and load-backs."""
    assert report.passed, report.failure()
    lines = {line.direction: line for line in report.transfers}
    assert sorted(lines) == ["device_to_host", "host_to_device"]
    assert lines["device_to_host"].tokens == report.backed_up_tokens > 0
    assert lines["host_to_device"].tokens == report.loaded_back_tokens > 0
    for line in lines.values():
        assert line.size_bytes > 0
        assert line.seconds is not None and 0 < line.seconds < report.engine_s
        assert line.gb_per_s == pytest.approx(line.size_bytes / line.seconds / 1e9)
        assert line.mean_host_run_tokens is not None and line.mean_host_run_tokens >= 16
    text = report.format()
    for name, line in (("device -> host", lines["device_to_host"]),
                       ("host -> device", lines["host_to_device"])):
        assert re.search(rf"  {name} +{line.size_bytes / 2**20:.2f} MiB \({line.tokens} "
                         rf"tokens\), [0-9]+\.[0-9]{{2}} GB/s over [0-9.]+ ms timed, host "
                         rf"runs [0-9.]+ tokens on average", text), text
    assert "n/a GB/s" not in text
    assert "wall time of synchronous CPU copies" in text


def test_the_host_swa_pool_is_reported_in_tokens_and_bytes(report: DemoReport) -> None:
    model = config_from_dict(default_data(), check_ram=False).model
    swa = report.swa
    assert swa is not None and swa["host_used_tokens"] > 0
    assert swa["host_used_bytes"] == swa["host_used_tokens"] * model.row_geometry.token_bytes(
        len(model.swa_layer_ids))


def test_the_json_report_holds_the_figures_and_the_verdict(report: DemoReport,
                                                           tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    report.write_json(path)
    text = path.read_text(encoding="utf-8")
    assert text.startswith('{\n  "config": ') and text.endswith("}\n")
    data = json.loads(text)
    assert data["saved_tokens"] == report.device_hit_tokens + report.host_hit_tokens > 0
    assert (data["passed"], data["failure"]) == (True, None)
    assert (data["l3"], data["l3_from_store_tokens"]) == (None, 0)
    assert data["prompt_tokens"] == (report.device_hit_tokens + report.host_hit_tokens
                                     + report.recomputed_tokens + report.new_tokens)
    assert len(data["transfers"]) == 2


def blank() -> DemoReport:
    return DemoReport(config="c", device="cpu", seed=0, requests=1, conversations=1)


def test_a_report_with_nothing_wrong_passes() -> None:
    fresh = blank()
    assert fresh.passed and fresh.failure() is None
    counts = {name: value for name, value in fresh.to_json().items()
              if name.endswith(("_tokens", "_requests", "_checked"))}
    assert len(counts) == 15 and set(counts.values()) == {0}
    assert fresh.format().endswith("result             PASS")
    assert "(0.0%)" in fresh.format()  # no prompt tokens: no division by zero


def test_shares_are_of_the_prompt_tokens() -> None:
    made = blank()
    made.prompt_tokens, made.device_hit_tokens, made.host_hit_tokens = 200, 50, 30
    text = made.format()
    assert re.search(r"from device +50  \(25\.0%\)", text)
    assert re.search(r"from host +30  \(15\.0%\)", text)
    assert re.search(r"prefill saved +80 tokens", text)


@pytest.mark.parametrize(("pages", "first_line"), [
    (1, "page 0 differs"),
    (3, "page 0 differs (and 2 more pages)"),
    (7, "page 0 differs (and 6 more pages)"),
])
def test_page_mismatches_fail_naming_the_first_and_listing_five(pages: int,
                                                                first_line: str) -> None:
    made = blank()
    made.page_mismatches = [f"page {n} differs" for n in range(pages)]
    made.token_mismatch = "a token differs"
    assert made.failure() == first_line and not made.passed
    text = made.format()
    assert [line for line in text.split("\n") if "MISMATCH page" in line] == [
        f"  MISMATCH page: page {n} differs" for n in range(min(pages, 5))]
    assert "  MISMATCH token: a token differs" in text
    assert text.endswith("result             FAIL")


def test_a_token_mismatch_or_a_corruption_that_never_happened_fails() -> None:
    made = blank()
    made.token_mismatch = "conversation 1 turn 2: token 3 differs"
    assert made.failure() == "conversation 1 turn 2: token 3 differs"
    made = blank()
    made.corruption_requested = True
    assert made.failure() == ("--corrupt-host-byte: no page was loaded back, so nothing was "
                              "corrupted")
    made.corrupted_host_slot = 5
    assert made.passed
    assert "one byte of host slot 5 (--corrupt-host-byte)" in made.format()


@pytest.mark.parametrize(("second", "from_store", "share"), [(0, 0, "0.0%"), (200, 50, "25.0%")])
def test_the_store_lines_give_the_second_instances_share(second: int, from_store: int,
                                                         share: str) -> None:
    made = blank()
    made.l3 = {"store": "file:///x", "stored_pages": 4, "second_prompt_tokens": second,
               "second_from_store_tokens": from_store, "second_pages_checked": 3,
               "second_store_pages_checked": 2}
    made.l3_from_store_tokens = 16
    text = made.format()
    assert ("file:///x: 4 pages stored; 16 prompt tokens came back from it after host "
            "eviction") in text
    assert (f"{from_store} of {second} prompt tokens ({share}) from the store; 2 loaded pages "
            f"from the store verified against the first instance's backups, 3 in all") in text


def test_the_timer_has_no_rate_before_an_op_and_closes_cleanly() -> None:
    service = build_service(config_from_dict(default_data(), check_ram=False))
    controller = service.controller
    timer = TransferTimer(controller)
    assert timer.rate("device_to_host") is None and timer.rate("host_to_device") is None
    assert timer.method == "wall time of synchronous CPU copies"
    timer.timed_bytes["device_to_host"] = 4096  # bytes acknowledged, none timed
    assert timer.rate("device_to_host") is None
    timer.seconds["device_to_host"] = 0.5
    assert timer.rate("device_to_host") == 4096 / 0.5 / 1e9
    timer.close()
    for name in ("start_writing", "start_loading", "poll_acks"):
        assert name not in controller.__dict__
    service.stop()
