"""``hicache demo --storage``: a second, empty instance serves the same requests from the
shared store, every page it takes from there verified against the first instance's rows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from hicache.config import load_config, load_default_config
from hicache.engine import DemoOptions, run_demo
from hicache.storage import FileStore, PageStatus, StorageResult


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


def test_pages_whose_put_failed_are_not_counted_as_stored(
        repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that refuses every put (a server gone after the start): 0 pages stored, each
    sent page counted as failed, and the second instance finds nothing there."""

    def refuse(self: FileStore, page_hashes: Sequence[bytes], *_: object,
               **__: object) -> StorageResult:
        return StorageResult((PageStatus.ERROR,) * len(page_hashes), "refused")

    monkeypatch.setattr(FileStore, "put", refuse)
    config = load_config(repo_root / "examples" / "full_attention.yaml")
    report = run_demo(config, DemoOptions(quick=True, storage="file", device="cpu"))
    assert report.l3 is not None
    assert report.l3["stored_pages"] == 0 and report.l3["failed_pages"] > 0
    assert report.l3["second_from_store_tokens"] == 0
    assert "0 pages stored" in report.format()
