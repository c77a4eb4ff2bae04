"""Audit of the benchmark tools: figures that were not what their labels say.

- ``bench e2e``'s checks could not fail for a host hit that loaded nothing: the evicted
  prefix's rows stayed in the slots the load-back got again (now NaN until loaded);
- ``bench e2e``'s ``copy`` ceiling took the warm-up runs into its best;
- ``bench storage``'s "put+get GB/s" counted the round the store finished after the turns;
- its raw Redis SET reference overwrote existing keys from its second repeat on, where
  hicache's put beside it writes fresh keys;
- ``bench scheduler --quick`` replaced the ``--sizes`` named, and its header called every
  row a median of ``--repeats`` calls where two rows take a tenth of them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
import torch
from storage_helpers import needs_redis, redis_server  # noqa: F401 (a fixture)

from hicache.bench import scheduler_cli, storage_turns
from hicache.bench.e2e.measure import E2EBench, E2EOptions, run_e2e
from hicache.bench.e2e.model import TINY
from hicache.bench.e2e.setup import Buffers
from hicache.bench.redis_local import RedisServer
from hicache.bench.scheduler import few_calls, measure_tree
from hicache.bench.scheduler_ops import measure_allocator
from hicache.bench.storage import Batch, measure_redis_py
from hicache.bench.workload import BenchmarkError
from hicache.controller import Direction
from hicache.controller.backends import TorchBackend
from hicache.pools import HostLayout
from hicache.storage import FileStore


def test_a_host_hit_that_loads_nothing_fails_the_e2e_run(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    real_copy = TorchBackend.copy
    dropped = []

    def copy_without_loads(self, moved, local_layers, direction, keep_alive):  # type: ignore[no-untyped-def]
        if direction is Direction.HOST_TO_DEVICE:
            dropped.append(len(local_layers))
            return  # no byte reaches the device
        real_copy(self, moved, local_layers, direction, keep_alive)

    monkeypatch.setattr(TorchBackend, "copy", copy_without_loads)
    opts = E2EOptions(spec=TINY, device=torch.device("cpu"), cached_tokens=(64,),
                      new_tokens=16, repeats=1, warmup=0, backend="torch")
    with pytest.raises(BenchmarkError, match="differ"):
        run_e2e(opts)
    assert dropped, "the host hit issued no load"


def test_an_e2e_run_whose_loads_move_the_rows_passes_bitwise() -> None:
    opts = E2EOptions(spec=TINY, device=torch.device("cpu"), cached_tokens=(64,),
                      new_tokens=16, repeats=1, warmup=0, backend="torch")
    (row,) = run_e2e(opts)
    assert row.outputs_equal


class ScriptedTimer:
    """Returns the given seconds, one a call, running the function as the real one does."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds = list(seconds)

    def __call__(self, fn):  # type: ignore[no-untyped-def]
        return self.seconds.pop(0), fn()


def test_the_copy_ceiling_is_the_best_of_the_repeats_not_of_the_warm_ups() -> None:
    cpu = torch.device("cpu")
    opts = E2EOptions(spec=TINY, device=cpu, cached_tokens=(64,), new_tokens=16, repeats=3,
                      warmup=2)
    bench = E2EBench(opts, service=None, model=None,  # type: ignore[arg-type]
                     buffers=Buffers(TINY, cpu, 64, 16))
    bench.timer = ScriptedTimer([0.001, 0.002, 0.005, 0.004, 0.006])  # type: ignore[assignment]
    assert bench.copy_ms(64) == 4.0


def test_put_get_rate_counts_only_the_rounds_done_while_the_turns_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of at least 0.3 s beside 10 turns of about 0.6 ms: none fits the window."""
    real_put = FileStore.put

    def slow_put(self, keys, pages, timeout_s=None):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        return real_put(self, keys, pages, timeout_s)

    monkeypatch.setattr(FileStore, "put", slow_put)
    rows = storage_turns.measure_turns("file", str(tmp_path), HostLayout.PAGE_FIRST_DIRECT,
                                       page_tokens=2, num_pages=3, turns=10)
    assert rows[3].figure.startswith("put+get GB/s") and rows[3].value == 0.0


@needs_redis
def test_the_raw_set_reference_writes_fresh_keys_every_repeat(
        redis_server: RedisServer) -> None:  # noqa: F811
    redis = pytest.importorskip("redis")
    existing: list[bool] = []

    class Watched(redis.Redis):  # type: ignore[misc,name-defined]
        def set(self, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
            existing.append(bool(self.exists(key)))
            return super().set(key, value, *args, **kwargs)

    client = Watched(host="127.0.0.1", port=redis_server.port)
    try:
        batch = Batch(page_tokens=2, num_pages=4)
        measure_redis_py(client, batch, repeats=3)
        assert len(existing) >= 3 * batch.num_pages and not any(existing)
    finally:
        client.flushall()
        client.close()


def test_quick_keeps_the_sizes_named_on_the_command_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[argparse.Namespace] = []

    def fake_measure(args: argparse.Namespace):  # type: ignore[no-untyped-def]
        seen.append(args)
        return [], []

    monkeypatch.setattr(scheduler_cli, "_measure", fake_measure)
    assert scheduler_cli.main(["--quick", "--sizes", "2000", "5000"]) == 0
    assert seen[0].sizes == [2000, 5000] and seen[0].repeats == 30
    assert "medians of 30 calls (3 for the 32k match, 5 for 2048 pages)" in \
        capsys.readouterr().out
    assert scheduler_cli.main(["--quick"]) == 0
    assert seen[1].sizes == [10_000, 100_000]
    assert scheduler_cli.main(["--repeats", "50"]) == 0
    assert seen[2].sizes == [10_000, 100_000, 1_000_000]


def test_the_few_call_rows_take_the_counts_the_header_names() -> None:
    repeats = 30
    figures = measure_tree(2000, repeats, seed=0)
    figures.update(measure_allocator(repeats))
    assert len(figures["match of a 32k-token prompt"]) == few_calls(repeats, 3) == 3
    assert len(figures["allocate + free 2048 pages, fragmented"]) == few_calls(repeats, 5) == 5
    assert len(figures["match of a 2k-token prompt"]) == repeats
