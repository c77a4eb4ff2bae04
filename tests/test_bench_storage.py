"""``hicache bench storage`` runs end to end on small batches and prints its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from storage_helpers import needs_redis

from hicache.cli import main


def test_bench_storage_file_prints_every_figure_and_writes_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file store's rows come with the sequential and O_DIRECT read references."""
    out = tmp_path / "bench.json"
    assert main(["bench", "storage", "--stores", "file", "--page-tokens", "2", "--batch-mib",
                 "2", "--repeats", "1", "--dir", str(tmp_path / "store"), "--json",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "get GB/s (page cache)" in text and "O_DIRECT read of the same files" in text
    rows = json.loads(out.read_text())
    assert {r["figure"] for r in rows} >= {"put GB/s", "get GB/s (O_DIRECT)",
                                           "exists of 128, ms", "checksum % of get"}
    assert all(r["value"] > 0 for r in rows if "GB/s" in r["figure"])


@needs_redis
def test_bench_storage_redis_compares_with_redis_py(capsys: pytest.CaptureFixture[str]) -> None:
    """Against a local server the Redis rows name the redis-py reference of the same run."""
    assert main(["bench", "storage", "--stores", "redis", "--page-tokens", "2",
                 "--batch-mib", "2", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "redis-py + hiredis GET, 1 connection" in text and "exists of 128, ms" in text


def test_bench_storage_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """A zero repeat count is a usage error (exit 2) naming the options."""
    assert main(["bench", "storage", "--stores", "file", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [
    (["--stores", "cluster", "--cluster", "redis://127.0.0.1:1"], "--cluster"),
    (["--stores", "file", "--dir", "f/sub"], "--dir f/sub"),
    (["--stores", "file", "--json", "f"], None),
], ids=["cluster-scheme", "dir-under-a-file", "json-existing-file"])
def test_bench_storage_checks_before_running(argv: list[str], named: str | None,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A bad ``--cluster`` or ``--dir``: exit 2 naming it; an existing ``--json`` file is a
    valid output (the check before the run leaves it; the run replaces it)."""
    from hicache.bench import storage_cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("x")
    monkeypatch.setattr(storage_cli, "_measure", lambda *_: [])
    code = main(["bench", "storage", "--quick", "--page-tokens", "2", *argv])
    err = capsys.readouterr().err
    if named is None:
        assert code == 0, err
    else:
        assert code == 2 and named in err and err.count("\n") == 1, err
