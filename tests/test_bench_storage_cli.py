"""``hicache bench storage``'s command line: the documented defaults, the pages each page
size gets for a batch, the smallest accepted counts, running servers probed only when their
store is measured, the missing-server check, and the table's order and page labels. The
measuring function is replaced by a recorder (the figures are tested in
tests/test_bench_storage_figures.py)."""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from hicache.bench import redis_local, storage_cli
from hicache.bench import storage as bench_storage
from hicache.bench.storage import Batch, Row
from hicache.bench.storage_cli import add_arguments, main, render
from hicache.cli.parser import FAILED, USAGE_ERROR

URLS: list[dict[str, str]] = []  # the store locations each recorded measurement got


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int, int]]:
    """(store, page KiB, pages, repeats) of every measurement the run asks for."""
    calls: list[tuple[str, int, int, int]] = []
    URLS.clear()

    def record(store: str, urls: dict[str, str], batch: Any, args: argparse.Namespace,
               stack: Any) -> list[Row]:
        calls.append((store, batch.page_bytes >> 10, batch.num_pages, args.repeats))
        URLS.append(dict(urls))
        return []

    monkeypatch.setattr(storage_cli, "_measure", record)
    return calls


def test_the_defaults_are_the_documented_ones() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.stores, args.page_tokens, args.batch_mib, args.repeats, args.turns,
            args.redis, args.cluster, args.dir, args.quick, args.json) == (
        ["file", "redis", "cluster"], [2, 16, 32], 128, 5, 2000, None, None, None, False, None)


def test_each_page_size_gets_a_batch_of_its_pages(
        measured: list[tuple[str, int, int, int]]) -> None:
    """128 MiB a call: 512 pages of 256 KiB, 64 of 2 MiB, 32 of 4 MiB; a batch smaller
    than one page is still one page."""
    assert main(["--stores", "file"]) == 0
    assert measured == [("file", 256, 512, 5), ("file", 2048, 64, 5), ("file", 4096, 32, 5)]
    measured.clear()
    assert main(["--stores", "file", "--page-tokens", "32", "--batch-mib", "1",
                 "--repeats", "1"]) == 0
    assert measured == [("file", 4096, 1, 1)]


def test_quick_is_8_mib_and_two_repeats_at_most(
        measured: list[tuple[str, int, int, int]]) -> None:
    assert main(["--stores", "file", "--quick", "--page-tokens", "1"]) == 0
    assert measured == [("file", 128, 64, 2)]
    measured.clear()
    assert main(["--stores", "file", "--quick", "--page-tokens", "1", "--batch-mib", "4",
                 "--repeats", "1"]) == 0
    assert measured == [("file", 128, 32, 1)]


def test_quick_times_200_turns_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    turns: list[int] = []
    monkeypatch.setattr(storage_cli, "_measure", lambda store, urls, batch, args, stack:
                        turns.append(args.turns) or [])
    assert main(["--stores", "file", "--quick", "--page-tokens", "1"]) == 0
    assert main(["--stores", "file", "--quick", "--page-tokens", "1", "--turns", "50"]) == 0
    assert main(["--stores", "file", "--page-tokens", "1", "--batch-mib", "1"]) == 0
    assert turns == [200, 50, 2000]


@pytest.mark.parametrize("option", ["--page-tokens", "--batch-mib", "--repeats", "--turns"])
def test_zero_is_refused(option: str, measured: list[tuple[str, int, int, int]],
                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--stores", "file", option, "0"]) == USAGE_ERROR
    assert option in capsys.readouterr().err and measured == []


def test_a_named_server_is_probed_only_when_its_store_is_measured(
        measured: list[tuple[str, int, int, int]], capsys: pytest.CaptureFixture[str]) -> None:
    """An unreachable --redis fails the run when Redis is measured (exit 1, naming it) and
    is not asked at all when only the file store is."""
    url = "redis://127.0.0.1:1"
    assert main(["--stores", "redis", "--redis", url]) == FAILED
    assert f"--redis {url}" in capsys.readouterr().err and measured == []
    assert main(["--stores", "file", "--redis", url, "--page-tokens", "1"]) == 0
    assert [store for store, *_ in measured] == ["file"]


def test_without_redis_server_only_named_servers_can_be_measured(
        monkeypatch: pytest.MonkeyPatch, measured: list[tuple[str, int, int, int]],
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(redis_local, "have_redis", lambda: False)
    assert main(["--stores", "file", "cluster"]) == USAGE_ERROR
    assert "redis-server is not installed" in capsys.readouterr().err
    assert main(["--stores", "file", "--page-tokens", "1"]) == 0  # no server needed
    # a named cluster needs no local server (it is probed, and nothing answers there)
    assert main(["--stores", "cluster", "--cluster", "redis+cluster://127.0.0.1:1"]) == FAILED
    assert "redis-server is not installed" not in capsys.readouterr().err
    assert main(["--stores", "redis", "--redis", "redis://127.0.0.1:1"]) == FAILED
    assert "redis-server is not installed" not in capsys.readouterr().err


def test_named_servers_are_measured_where_they_are(
        monkeypatch: pytest.MonkeyPatch, measured: list[tuple[str, int, int, int]]) -> None:
    """A store named with --redis / --cluster is the one measured (no local server is
    started in its place), and a store not measured gets no location at all."""
    monkeypatch.setattr(storage_cli.arg_checks, "reachable", lambda option, url: None)
    redis, cluster = "redis://127.0.0.1:7000", "redis+cluster://127.0.0.1:7001"
    assert main(["--stores", "redis", "cluster", "--redis", redis, "--cluster", cluster,
                 "--page-tokens", "1", "--batch-mib", "1"]) == 0
    assert [(urls["redis"], urls["cluster"]) for urls in URLS] == [(redis, cluster)] * 2
    URLS.clear()
    assert main(["--stores", "file", "--page-tokens", "1", "--batch-mib", "1"]) == 0
    assert [set(urls) for urls in URLS] == [{"file"}]


def test_the_table_puts_the_file_store_first_and_names_page_sizes() -> None:
    rows = [Row("redis", 4096, "get GB/s", 2.0, 4.0, "redis-py GET"),
            Row("redis", 1024, "get GB/s", 2.0, 4.0, "redis-py GET"),
            Row("file", 2048, "put GB/s", 3.0, None, ""),
            Row("cluster", 256, "exists of 128, ms", 0.5, 1.0, "pipeline"),
            Row("file", 256, "get GB/s", 6.0, 3.0, "sequential read")]
    header, rule, *lines, footer = render(rows).splitlines()
    assert header.split()[:6] == ["store", "page", "figure", "hicache", "raw", "ratio"]
    assert set(rule) == {"-"} and footer.startswith("(ratio:")
    assert [line.split()[:3] for line in lines] == [
        ["file", "256", "KiB"], ["file", "2", "MiB"], ["cluster", "256", "KiB"],
        ["redis", "1", "MiB"], ["redis", "4", "MiB"]]
    assert lines[0].split()[-5:] == ["6.000", "3.000", "2.00x", "sequential", "read"]
    assert lines[1].split()[-3:] == ["put", "GB/s", "3.000"]  # no reference: no raw, ratio
    assert lines[2].split()[-4:] == ["0.500", "1.000", "2.00x", "pipeline"]


def test_the_file_store_figures_come_from_the_stores_they_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file store's rows: the unchecked get from a store opened without checksums, the
    O_DIRECT get from stores opened with O_DIRECT (with and without checksums), each get
    beside its raw read of the same files; the scheduler's turns beside a store of each
    host layout, opened with the defaults; every store is left empty."""
    import hicache.storage as storage_package

    opened: list[dict[str, Any]] = []  # the options of every file store opened
    real_init = storage_package.FileStore.__init__

    def spied_init(self: Any, root: Any, namespace: Any, **options: Any) -> None:
        opened.append(options)
        real_init(self, root, namespace, **options)

    monkeypatch.setattr(storage_package.FileStore, "__init__", spied_init)
    reads: list[bool] = []  # the raw reads: through the page cache, then O_DIRECT
    real_read = bench_storage.measure_sequential_read

    def spied_read(*args: Any, direct: bool) -> float:
        reads.append(direct)
        return real_read(*args, direct=direct)

    monkeypatch.setattr(bench_storage, "measure_sequential_read", spied_read)
    batch = Batch(page_tokens=2, num_pages=2)
    args = argparse.Namespace(repeats=1, turns=4)
    try:
        with ExitStack() as stack:
            rows = storage_cli._measure("file", {"file": str(tmp_path)}, batch, args, stack)
    except OSError as exc:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(f"O_DIRECT refused here: {exc}")
    assert opened == [{}, {"checksum": False}, {"direct_io": True},
                      {"direct_io": True, "checksum": False}, {}, {}]
    assert reads == [False, True]
    by_figure = {row.figure: row for row in rows}
    turns = {f"{figure}, {layout}" for layout in ("layer_first", "page_first_direct")
             for figure in ("turn mean us", "turn p50 us", "turn p99 us", "put+get GB/s")}
    assert set(by_figure) == {"get GB/s, no checksum", "checksum % of get", "put GB/s",
                              "get GB/s (page cache)", "get GB/s (O_DIRECT)",
                              "exists of 128, ms"} | turns
    assert by_figure["get GB/s (page cache)"].reference_name == \
        "sequential read of the same files"
    assert by_figure["get GB/s (O_DIRECT)"].reference_name == "O_DIRECT read of the same files"
    assert all(row.page_kib == 2 * 128 and row.store == "file" for row in rows)
    assert not list(tmp_path.rglob("*.kv"))
