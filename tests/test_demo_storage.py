"""``hicache demo --storage``: a second, empty instance serves the same requests from the
shared store, every page it takes from there verified against the first instance's rows."""

from __future__ import annotations

from pathlib import Path

from hicache.config import load_config, load_default_config
from hicache.engine import DemoOptions, run_demo


def test_the_second_instance_is_served_from_the_store(repo_root: Path) -> None:
    config = load_config(repo_root / "examples" / "full_attention.yaml")
    report = run_demo(config, DemoOptions(quick=True, storage="file", device="cpu"))
    assert report.passed, report.failure()
    assert report.l3 is not None
    assert report.l3["stored_pages"] > 0
    assert report.l3["second_from_store_tokens"] > 0
    assert report.l3["unknown_pages"] == 0
    assert report.l3["arrived_pages"] > 0
    assert "second instance" in report.format()


def test_the_default_hybrid_config_shares_pages_with_their_window_rows() -> None:
    report = run_demo(load_default_config(), DemoOptions(quick=True, storage="file"))
    assert report.passed, report.failure()
    assert report.l3 is not None and report.l3["second_from_store_tokens"] > 0
    assert report.swa is not None
