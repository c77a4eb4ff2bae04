"""``hicache bench storage``'s figures: the pages are the model's documented shape, each
ratio reads "better than the reference" above 1 whichever way its figure goes, a clock times
only its call, a store's figures are rates of the batch's bytes with the checksum's share
between 0 and 100%, the O_DIRECT reference really opens its files with O_DIRECT, and the
redis-py reference leaves no key behind."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from storage_helpers import needs_redis

import hicache.bench.storage as storage_module
from hicache.bench.storage import (
    EXISTS_KEYS,
    Batch,
    Row,
    file_paths,
    measure_redis_py,
    measure_sequential_read,
    measure_store,
    median_s,
)
from hicache.storage import FileStore

MODEL_TOKEN_BYTES = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16


def test_a_batch_is_pages_of_the_benchmark_model() -> None:
    batch = Batch(page_tokens=2, num_pages=3)
    assert batch.page_bytes == 2 * MODEL_TOKEN_BYTES
    assert batch.batch_bytes == 3 * 2 * MODEL_TOKEN_BYTES
    space = batch.namespace
    assert (space.num_layers, space.num_components, space.row_elems, space.page_size,
            space.dtype, space.layout) == (32, 2, 8 * 128, 2, "bfloat16", "page_first")
    assert len(batch.keys) == 3 + EXISTS_KEYS and len(set(batch.keys)) == len(batch.keys)
    assert [len(page[0]) for page in batch.source + batch.target] == [batch.page_bytes] * 6
    assert not batch.same()  # the targets start empty, the sources random
    for source, target in zip(batch.source, batch.target, strict=True):
        target[0][:] = source[0]
    assert batch.same()
    batch.scramble_target()
    assert not batch.same()


@pytest.mark.parametrize(("figure", "value", "reference", "ratio"), [
    ("get GB/s", 6.0, 3.0, 2.0), ("put GB/s", 1.0, 4.0, 0.25),
    ("exists of 128, ms", 0.5, 1.0, 2.0), ("exists of 128, ms", 2.0, 1.0, 0.5),
    ("get GB/s", 6.0, None, None), ("get GB/s", 6.0, 0.0, None)])
def test_a_ratio_is_above_one_when_the_store_does_better(
        figure: str, value: float, reference: float | None, ratio: float | None) -> None:
    assert Row("file", 64, figure, value, reference, "ref").ratio == ratio


def test_a_median_times_the_call_and_not_what_runs_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(storage_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def advance(by: float) -> Any:
        return lambda: clock.__setitem__(0, clock[0] + by)

    durations = iter([3.0, 1.0, 2.0])
    assert median_s(lambda: advance(next(durations))(), 3, before=advance(100.0)) == 2.0


def test_a_store_figures_are_rates_of_the_batch(tmp_path: Path) -> None:
    """Through a file store: put, get and unchecked get in GB/s of the batch's bytes, the
    exists call in milliseconds, the checksum's share of a get within 0-100%; the pages
    read back are the pages put."""
    batch = Batch(page_tokens=2, num_pages=4)
    with FileStore(tmp_path, batch.namespace) as store, \
            FileStore(tmp_path, batch.namespace, checksum=False) as unchecked:
        got = measure_store("file", store, unchecked, batch, repeats=2)
        assert all(path.is_file() for path in file_paths(store, batch.keys[:4]))
    assert batch.same()
    assert set(got) == {"put", "get", "get_unchecked", "exists_ms", "checksum_pct"}
    assert all(0 < got[name] < 1e4 for name in ("put", "get", "get_unchecked", "exists_ms"))
    assert 0 <= got["checksum_pct"] < 100


def test_a_store_that_returns_other_bytes_fails_the_figure(tmp_path: Path) -> None:
    batch = Batch(page_tokens=2, num_pages=2)

    class Skewed(FileStore):
        def get(self, keys: Any, targets: Any, **kwargs: Any) -> Any:
            result = super().get(keys, targets, **kwargs)
            targets[0][0][0] ^= 1
            return result

    with Skewed(tmp_path, batch.namespace) as store, \
            FileStore(tmp_path, batch.namespace, checksum=False) as unchecked, \
            pytest.raises(RuntimeError, match="file: pages read back differ"):
        measure_store("file", store, unchecked, batch, repeats=1)


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "o-direct"])
def test_the_sequential_reference_reads_whole_files_the_way_it_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    if direct and not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    batch = Batch(page_tokens=2, num_pages=2)
    with FileStore(tmp_path, batch.namespace) as store:
        measure_store("file", store, store, batch, repeats=1)
        paths, header_len = file_paths(store, batch.keys[:2]), store.format.header_len
    flags: list[int] = []
    real_open = os.open

    def spied_open(path: Any, mode: int, *args: Any) -> int:
        flags.append(mode)
        return real_open(path, mode, *args)

    monkeypatch.setattr(os, "open", spied_open)
    batch.scramble_target()
    try:
        rate = measure_sequential_read(paths, header_len, batch, 2, direct=direct)
    except OSError as exc:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(f"O_DIRECT refused here: {exc}")
    assert rate > 0 and batch.same()  # the payload lands in the target pages
    o_direct = getattr(os, "O_DIRECT", 0)
    assert flags and all(bool(mode & o_direct) == direct for mode in flags)
    assert all(mode & (os.O_WRONLY | os.O_RDWR) == 0 for mode in flags)


@needs_redis
def test_the_redis_py_reference_leaves_no_key(tmp_path: Path) -> None:
    import redis

    from hicache.bench.redis_local import RedisServer

    server = RedisServer(tmp_path).start()
    try:
        client = redis.Redis(port=server.port)
        got = measure_redis_py(client, Batch(page_tokens=2, num_pages=3), repeats=2)
        assert set(got) == {"put", "get", "exists_ms"}
        assert all(0 < value < 1e4 for value in got.values())
        assert client.dbsize() == 0
        client.close()
    finally:
        server.stop()
