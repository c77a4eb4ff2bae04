"""The benchmarks' shared option checks at their bounds: the smallest accepted value is
accepted and the next one down refused, each with a message that names the option, the
value and the rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hicache.bench import arg_checks
from hicache.bench.trace import BLOCK, TraceRequest
from hicache.cli.parser import UsageError


def test_at_least_takes_one_value_or_several() -> None:
    arg_checks.at_least("--repeats", 1, 1)
    arg_checks.at_least("--sizes", [1000, 5000], 1000)
    with pytest.raises(UsageError,
                       match=r"^--repeats 0: must be >= 1; give a whole number >= 1$"):
        arg_checks.at_least("--repeats", 0, 1)
    with pytest.raises(UsageError, match=r"^--sizes 999: must be >= 1000"):
        arg_checks.at_least("--sizes", [5000, 999], 1000)


def test_in_range_closed_and_open_bounds() -> None:
    arg_checks.in_range("--x", 0.0, 0.0)
    arg_checks.in_range("--x", 1.0, 0.0, 1.0)
    arg_checks.in_range("--x", 1e-9, 0.0, low_open=True)
    with pytest.raises(UsageError, match=r"^--x -0\.5: must be a finite number >= 0; give a "
                                         r"finite number >= 0$"):
        arg_checks.in_range("--x", -0.5, 0.0)
    with pytest.raises(UsageError, match=r"^--x 0: must be a finite number > 0;"):
        arg_checks.in_range("--x", 0.0, 0.0, low_open=True)
    with pytest.raises(UsageError, match=r"^--x 1\.5: must be a finite number >= 0 and <= 1;"):
        arg_checks.in_range("--x", 1.5, 0.0, 1.0)
    for bad in (math.inf, math.nan):
        with pytest.raises(UsageError, match="a finite number"):
            arg_checks.in_range("--x", bad, 0.0)


def test_capacities_at_their_bounds() -> None:
    assert arg_checks.capacities("--capacities", ["1:1", "8:9"], host_at_least_device=True) \
        == [(1, 1), (8, 9)]
    assert arg_checks.capacities("--capacities", ["8:1"], host_at_least_device=False) \
        == [(8, 1)]
    for text, host_at_least_device, rule in [
            ("0:5", False, "host >= 1 block"), ("8:7", True, "host >= device"),
            ("8:0", False, "host >= 1 block"), ("0:0", True, "host >= device")]:
        with pytest.raises(UsageError, match=f"^--capacities {text}: need device >= 1 block "
                                             f"and {rule}, e.g. 2000:8000$"):
            arg_checks.capacities("--capacities", [text],
                                  host_at_least_device=host_at_least_device)
    for text in ("8", "a:b", "1:2:3", ""):
        with pytest.raises(UsageError, match=f"^--capacities {text}: not DEVICE:HOST"):
            arg_checks.capacities("--capacities", [text], host_at_least_device=False)


def test_a_device_must_hold_the_longest_request() -> None:
    requests = [TraceRequest(BLOCK, (1,)), TraceRequest(2 * BLOCK + 1, (1, 2, 3))]
    arg_checks.fits("--capacities", [(3, 3)], requests)
    arg_checks.fits("--capacities", [(1, 1)], [])
    with pytest.raises(UsageError, match=rf"^--capacities 2:9: the trace's longest request of "
                                         rf"{2 * BLOCK + 1} tokens needs a device of >= 3 "
                                         rf"blocks; give device >= 3$"):
        arg_checks.fits("--capacities", [(3, 3), (2, 9)], requests)


def test_a_store_of_the_wrong_kind_is_named(tmp_path: Path) -> None:
    assert arg_checks.store("--redis", "redis://127.0.0.1:6379", schemes=("redis",)).scheme \
        == "redis"
    with pytest.raises(UsageError, match=r"^--redis file:///x: not a redis://host:port URL; "
                                         r"give e\.g\. redis://127\.0\.0\.1:6379$"):
        arg_checks.store("--redis", "file:///x", schemes=("redis",))
    with pytest.raises(UsageError, match=r"^--cluster redis://h:1: not a redis\+cluster://"):
        arg_checks.store("--cluster", "redis://h:1", schemes=("redis+cluster",))
    location = arg_checks.store("--storage", str(tmp_path / "new"), schemes=("file", "redis"))
    assert location.scheme == "file" and location.path == str(tmp_path / "new")
    with pytest.raises(UsageError, match="a redis location; give a directory"):
        arg_checks.store("--dir", "redis://h:1", schemes=("file",))
