"""The transfer benchmark's pure parts (report, JSON, auto-table choice, arguments) and its
controller driving and verification on a CPU; the GPU run itself skips without CUDA."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gpu_shapes import under_sanitizer

from hicache.bench import main
from hicache.bench.auto import (
    auto_table,
    choose_rows,
    engine_cost_ms,
    median_records,
    pick_backend,
)
from hicache.bench.cli import add_bench_parser, check_args, parse_args
from hicache.bench.plot import have_matplotlib
from hicache.bench.report import render, targets
from hicache.bench.results import BenchResult, Ceiling, Measurement, load_json, save_json
from hicache.bench.timing import split_spans
from hicache.bench.verify import Verifier, randomize
from hicache.bench.workload import (
    BenchmarkError,
    Session,
    Shape,
    host_page_sizes,
    make_device_pool,
    make_host_pool,
    make_slots,
)
from hicache.controller import Direction, MovedTransfer, TorchBackend, TransferBackend
from hicache.controller.auto import AutoRow, load_table
from hicache.controller.direct import DirectBackend
from hicache.controller.staged import StagedBackend
from hicache.pools import HostLayout

TOKENS = 32768
LAYOUTS = ("layer_first", "page_first")


def measurement(backend: str, kind: str, page: int, layout: str, gbps: float,
                slowdown: float | None = 1.0, tokens: int = TOKENS) -> Measurement:
    ceiling = 110.0 if kind == "both" else 55.0
    m = Measurement(backend, kind, page, layout, tokens, tokens * 131072,
                    tokens * 131072 / gbps / 1e9, gbps, 100.0 * gbps / ceiling, slowdown,
                    executed_by=backend)
    if kind == "load":
        m.layer0_s, m.layer0_ratio, m.all_ratio = 0.004, 1.7, 55.0 / gbps
    return m


def synthetic_result() -> BenchResult:
    """Kernel fast but heavy on the matmul, staged a little slower and light, torch slow."""
    rows = []
    for page in (1, 16):
        for layout in LAYOUTS:
            for backend, gbps, slowdown in (("torch", 12.0, 0.5), ("kernel", 52.0, 15.0),
                                            ("staged", 53.5, 2.0), ("auto", 53.4, 2.1)):
                for kind in ("write", "load"):
                    rows.append(measurement(backend, kind, page, layout, gbps, slowdown))
                rows.append(measurement(backend, "both", page, layout, 2 * gbps - 6, None))
            for tokens in (256, 2048):
                for kind in ("write", "load"):
                    rows.append(measurement("kernel", kind, page, layout, 30.0, 12.0, tokens))
                    rows.append(measurement("staged", kind, page, layout, 26.0, 1.0, tokens))
    meta = {"device": "Test GPU", "torch": "2.x", "triton": "3.x", "date": "2026-01-01",
            "tokens": TOKENS, "layers": 32, "heads": 8, "head_dim": 128,
            "token_bytes": 131072, "transfer_bytes": TOKENS * 131072, "repeats": 5,
            "torch_repeats": 2, "matmul_size": 8192, "staging_tokens": 1024}
    return BenchResult(meta, Ceiling(TOKENS * 131072, 55.0, 55.0, 110.0, 0.1, 0.0), 0.0014,
                       {"write": 2 << 27, "load": 2 << 22}, rows,
                       auto_table(rows, {"device": "Test GPU"}))


# ---- report -------------------------------------------------------------------------------


def test_table_has_a_line_per_configuration() -> None:
    """The main table holds one line per (backend, page size, layout), run order."""
    lines = render(synthetic_result()).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backend page"))
    body = lines[start + 2: start + 2 + 16]
    assert [line.split()[:3] for line in body[:4]] == [
        ["torch", "1", "layer_first"], ["kernel", "1", "layer_first"],
        ["staged", "1", "layer_first"], ["auto", "1", "layer_first"]]
    assert body[2].split()[3:6] == ["53.5", "97.3", "2.0"]
    assert len({len(line) for line in body}) == 1


def test_loads_by_size_show_issue_time() -> None:
    """Every layer-wise load measured, every size, has a line with its issue ms and the
    issue's share of the op; a result without issue times prints '-'."""
    result = synthetic_result()
    for m in result.measurements:
        m.issue_s = m.seconds / 4 if m.tokens == 256 else None
    lines = render(result).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layer-wise loads by"))
    assert lines[start + 1].split()[3:] == ["tokens", "load", "%h2d", "op", "ms", "issue", "ms",
                                            "issue/op", "L0", "ms"]
    body = lines[start + 3: start + 3 + 32]
    assert len({len(line) for line in body}) == 1
    small = [line.split() for line in body if line.split()[3] == "256"]
    assert [(cells[0], cells[7], cells[8]) for cells in small[:2]] == [
        ("kernel", "0.280", "0.25"), ("staged", "0.323", "0.25")]
    assert len(small) == 8 and all(cells[8] == "0.25" for cells in small)
    assert all(line.split()[7:9] == ["-", "-"] for line in body if " 32768 " in line)


def test_engine_copy_table_shows_each_configurations_waits_beside_the_copy_alone() -> None:
    """One line per configuration whose main-size ops were measured with an engine's copy
    beside them, write and load in ms, under a header with the copy alone; a run without
    the figures (an older JSON) says so."""
    result = synthetic_result()
    assert "an engine's copy during an op: not measured" in render(result)
    result.ceiling.engine_copy_d2h_s, result.ceiling.engine_copy_h2d_s = 12e-6, 11e-6
    for m in result.main_rows():
        if m.kind != "both" and m.page_size == 16:
            m.engine_copy_s = {"kernel": 20e-6, "staged": 0.9e-3}.get(m.backend, 76e-3) * (
                2 if m.kind == "load" else 1)
    lines = render(result).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("an engine's 64 KiB"))
    assert "(alone: 0.012 to the host, 0.011 to the device)" in lines[start]
    end = lines.index("", start)
    body = lines[start + 3: end]
    assert len(body) == 4 * len(LAYOUTS)  # page 16 alone measured
    assert [line.split() for line in body[:4]] == [
        ["torch", "16", "layer_first", "76.000", "152.000"],
        ["kernel", "16", "layer_first", "0.020", "0.040"],
        ["staged", "16", "layer_first", "0.900", "1.800"],
        ["auto", "16", "layer_first", "76.000", "152.000"]]
    assert len({len(line) for line in body}) == 1


def test_targets_name_what_is_missed() -> None:
    """A staged page-1 load under 90% of the ceiling is marked MISS and listed."""
    result = synthetic_result()
    load = result.find("staged", "load", 1, "page_first")
    assert load is not None
    load.pct_of_ceiling = 80.0
    missed = [t for t in targets(result) if not t.met]
    assert [(t.backend, t.page_size, t.layout, t.name) for t in missed] == [
        ("staged", 1, "page_first", "load")]
    text = render(result)
    assert "targets met: 55 of 56" in text
    assert "MISSED staged page 1 page_first load: 80.00, target >= 90 (by 10.00)" in text


def test_a_target_is_met_at_its_bound_and_missed_when_not_measured() -> None:
    """A value exactly at its bound meets it (>= for rates, <= for slowdowns); a figure the
    run did not measure is a MISS, reported as not measured, never an ok."""
    result = synthetic_result()
    write = result.find("staged", "write", 16, "layer_first")
    load = result.find("staged", "load", 16, "layer_first")
    assert write is not None and load is not None
    write.pct_of_ceiling, load.slowdown_pct = 97.0, 3.0
    result.measurements.remove(result.find("staged", "both", 16, "layer_first"))
    checks = {t.name: t for t in targets(result)
              if (t.backend, t.page_size, t.layout) == ("staged", 16, "layer_first")}
    assert checks["write"].met and checks["mm%l"].met
    assert not checks["both"].met and checks["both"].value is None
    assert checks["both"].describe() == ("staged page 16 layer_first both: not measured, "
                                         "target >= 90")
    assert checks["mm%l"].describe() == ("staged page 16 layer_first mm%l: 3.00, target <= 3 "
                                         "(by 0.00)")


def test_each_direction_is_compared_with_its_own_ceiling() -> None:
    """A write's percentage is of the device-to-host ceiling, a load's of host-to-device,
    both directions' of the two at once (they differ on real links)."""
    ceiling = Ceiling(1 << 30, d2h_gb_per_s=50.0, h2d_gb_per_s=60.0, bidir_gb_per_s=100.0)
    assert [ceiling.one_way(kind) for kind in ("write", "load", "both")] == [50.0, 60.0, 100.0]


def test_the_header_says_which_device_slots_were_moved() -> None:
    result = synthetic_result()
    assert "device slots: random whole pages;" in render(result)
    result.meta["slots"] = "runs"
    assert "device slots: one run of consecutive pages per op;" in render(result)


def test_targets_hold_issue_14s_bounds() -> None:
    """At pages of 16 a write needs 97% of the ceiling and a load 95%, and the matmul may
    slow by 3% at most: a write at 96%, a load at 95.5% and a slowdown of 3.5% are two
    misses and a pass."""
    result = synthetic_result()
    write = result.find("staged", "write", 16, "page_first")
    load = result.find("auto", "load", 16, "layer_first")
    assert write is not None and load is not None
    write.pct_of_ceiling, load.pct_of_ceiling, load.slowdown_pct = 96.0, 95.5, 3.5
    missed = [(t.backend, t.layout, t.name) for t in targets(result) if not t.met]
    assert missed == [("staged", "page_first", "write"), ("auto", "layer_first", "mm%l")]
    assert "write >= 97% and load >= 95% of the one-way ceiling" in render(result)
    assert "mm% <= 3;" in render(result)


def test_json_round_trip(tmp_path: Path) -> None:
    """A saved result loads back equal, field for field."""
    result = synthetic_result()
    path = tmp_path / "bench.json"
    save_json(result, path)
    assert load_json(path) == result


def run_cli(argv: Sequence[str]) -> int:
    """``hicache bench ARGV`` through a parser built the way hicache.cli builds its own."""
    parser = argparse.ArgumentParser(prog="hicache")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return int(args.run(args))


def test_from_json_rerenders_without_gpu(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--from-json prints the same report as the run that saved it."""
    result = synthetic_result()
    path = tmp_path / "bench.json"
    save_json(result, path)
    assert main(["--from-json", str(path)]) == 0
    assert capsys.readouterr().out == render(result) + "\n"
    assert run_cli(["--from-json", str(path)]) == 0
    assert capsys.readouterr().out == render(result) + "\n"


def test_from_json_writes_the_auto_table(tmp_path: Path) -> None:
    """--auto-table from a saved result writes rows that controller.auto loads."""
    path, table = tmp_path / "bench.json", tmp_path / "auto_table.json"
    save_json(synthetic_result(), path)
    assert main(["--from-json", str(path), "--auto-table", str(table)]) == 0
    rows = load_table(table)
    assert AutoRow(Direction.DEVICE_TO_HOST, HostLayout.PAGE_FIRST, False, 0, "staged") in rows
    assert AutoRow(Direction.HOST_TO_DEVICE, HostLayout.LAYER_FIRST, True, 8192,
                   "staged") in rows
    assert json.loads(table.read_text())["measured_on"] == {"device": "Test GPU"}


def noisy_run(staged_write_gbps: float, device: str = "Test GPU") -> BenchResult:
    """:func:`synthetic_result` with the staged 256-token writes of ``layer_first`` at page
    16 moved to ``staged_write_gbps`` (a run where the CPU was slow for small ops)."""
    result = synthetic_result()
    rows = [replace(m, gb_per_s=staged_write_gbps)
            if (m.backend, m.kind, m.page_size, m.layout, m.tokens)
            == ("staged", "write", 16, "layer_first", 256) else m
            for m in result.measurements]
    return replace(result, meta={**result.meta, "device": device}, measurements=rows,
                   auto_table=auto_table(rows, {"device": device}))


def small_write_choice(table: dict[str, object]) -> str:
    rows = table["rows"]
    assert isinstance(rows, list)
    return next(r["backend"] for r in rows if r["direction"] == "device_to_host"
                and r["layout"] == "layer_first" and r["measured_tokens"] == 256)


def test_auto_table_of_several_runs_takes_the_median(tmp_path: Path) -> None:
    """One run whose staged small write fell to 15 GB/s (below 0.6 of the kernel's 30) would
    send those writes to the kernel on its own; over three runs the median (26) keeps them
    staged. The merged figures say how many runs measured them, the rule and measured_on
    how the table was made."""
    runs = [noisy_run(15.0), noisy_run(26.0), noisy_run(27.0)]
    assert small_write_choice(runs[0].auto_table) == "kernel"
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        save_json(run, paths[-1])
    table_path = tmp_path / "auto_table.json"
    assert main(["--from-json", *map(str, paths), "--auto-table", str(table_path)]) == 0
    table = json.loads(table_path.read_text())
    assert small_write_choice(table) == "staged"
    assert table["rule"].startswith("median of each figure over 3 runs; ")
    assert table["measured_on"]["runs"] == 3
    merged = next(r for r in table["measurements"] if (
        r["backend"], r["direction"], r["layout"], r["page_size"], r["tokens"])
        == ("staged", "device_to_host", "layer_first", 16, 256))
    assert (merged["gb_per_s"], merged["runs"]) == (26.0, 3)
    # the noisy run alone, given on its own, still writes its own table
    assert main(["--from-json", str(paths[0]), "--auto-table", str(table_path)]) == 0
    assert small_write_choice(json.loads(table_path.read_text())) == "kernel"


def test_median_records_keep_an_unmeasured_slowdown_unknown() -> None:
    """A slowdown no run measured stays None; one that some runs measured is their median."""
    base = {"direction": "device_to_host", "layout": "layer_first", "layer_wise": False,
            "tokens": 256, "page_size": 16, "backend": "kernel"}
    merged = median_records([[{**base, "gb_per_s": 10.0, "slowdown_pct": None}],
                             [{**base, "gb_per_s": 30.0, "slowdown_pct": 4.0}],
                             [{**base, "gb_per_s": 20.0, "slowdown_pct": 2.0}]])
    assert [(m["gb_per_s"], m["slowdown_pct"], m["runs"]) for m in merged] == [(20.0, 3.0, 3)]
    assert median_records([[{**base, "gb_per_s": 1.0, "slowdown_pct": None}]])[0][
        "slowdown_pct"] is None


def test_median_records_take_the_issue_and_op_times_too() -> None:
    """The issue and op times of the engine's cost per op are medians over the runs that
    kept them; a run saved before they were kept leaves them out, and none kept: None."""
    base = {"direction": "host_to_device", "layout": "layer_first", "layer_wise": True,
            "tokens": 256, "page_size": 16, "backend": "kernel", "slowdown_pct": 8.0}
    merged = median_records([[{**base, "gb_per_s": 10.0}],
                             [{**base, "gb_per_s": 30.0, "issue_ms": 0.6, "op_ms": 0.7}],
                             [{**base, "gb_per_s": 20.0, "issue_ms": 0.2, "op_ms": 0.5}]])
    assert (merged[0]["issue_ms"], merged[0]["op_ms"]) == (pytest.approx(0.4),
                                                            pytest.approx(0.6))
    alone = median_records([[{**base, "gb_per_s": 10.0}]])[0]
    assert (alone["issue_ms"], alone["op_ms"]) == (None, None)


def test_runs_of_different_devices_are_refused(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """One table is for one device: runs of two devices exit 2 with one line naming them."""
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    save_json(noisy_run(26.0), paths[0])
    save_json(noisy_run(26.0, device="Other GPU"), paths[1])
    table_path = tmp_path / "auto_table.json"
    assert main(["--from-json", *map(str, paths), "--auto-table", str(table_path)]) == 2
    err = capsys.readouterr().err
    assert "different devices" in err and "Other GPU" in err and err.count("\n") == 1
    assert not table_path.exists()


def test_bad_json_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file that is not a saved result exits 2 with one line on stderr naming the option
    and the file."""
    path = tmp_path / "other.json"
    path.write_text('{"rows": []}')
    assert main(["--from-json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hicache bench: error: --from-json {path}: not a hicache bench "
                          f"result")
    assert err.count("\n") == 1


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--plot writes a PNG, or says in one line that matplotlib is needed."""
    path = tmp_path / "bench.json"
    save_json(synthetic_result(), path)
    code = main(["--from-json", str(path), "--plot", str(tmp_path / "bench.png")])
    if have_matplotlib():
        assert code == 0
        assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert code == 2
        assert capsys.readouterr().err == (
            "hicache bench: error: --plot needs matplotlib: pip install 'hicache[plot]'\n")


# ---- auto table -----------------------------------------------------------------------------


def test_fastest_within_slowdown_bound_wins() -> None:
    """A faster backend that slows the matmul by more than 5% loses to a slower one."""
    assert pick_backend({"kernel": (52.0, 15.0, None), "staged": (45.0, 4.9, None)},
                        5.0) == "staged"
    assert pick_backend({"kernel": (52.0, 5.0, None), "staged": (53.0, 6.0, None)}, 5.0) == "kernel"


def test_least_slowdown_wins_when_none_qualifies() -> None:
    """If every backend slows the matmul too much, the one slowing it least among those
    fast enough wins; an unknown slowdown counts as the worst; a backend below the share
    of the fastest is not considered even if it spares the matmul."""
    assert pick_backend({"kernel": (52.0, 15.0, None), "staged": (45.0, None, None)},
                        5.0) == "kernel"
    assert pick_backend({"kernel": (51.3, 32.5, None), "staged": (46.3, 4.5, None)},
                        3.0) == "staged"
    assert pick_backend({"kernel": (49.0, 8.0, None), "staged": (19.5, 4.0, None)}, 3.0,
                        0.6) == "kernel"


def test_least_engine_cost_wins_when_none_qualifies() -> None:
    """When no backend is within the bound and every one reaching the share has a cost per
    op, the cheapest wins, whatever it does to the matmul: a 256-token load that takes
    0.3 ms more to issue costs the scheduler thread more than 5% of its 0.67 ms costs the
    matmul. Within the bound the fastest still wins, and one cost unknown brings back the
    least slowdown."""
    small_load = {"kernel": (27.3, 8.6, 0.61), "staged": (17.6, 3.4, 1.02)}
    assert pick_backend(small_load, 3.0) == "kernel"
    assert pick_backend(small_load, 4.0) == "staged"
    assert pick_backend({"kernel": (27.3, 8.6, 0.61), "staged": (17.6, 3.4, None)},
                        3.0) == "staged"
    assert pick_backend({"kernel": (27.3, 8.6, 0.61), "staged": (10.0, 0.1, 0.05)},
                        3.0) == "kernel"  # below the share: no candidate however cheap


def test_engine_cost_of_a_record() -> None:
    """CPU issue plus the slowdown's share of the op's GPU time; a missing figure (a run
    saved before the issue time was kept) gives no cost; a speed-up costs no matmul."""
    base = {"slowdown_pct": 10.0, "issue_ms": 0.5, "op_ms": 2.0}
    assert engine_cost_ms(base) == pytest.approx(0.7)
    assert engine_cost_ms({**base, "slowdown_pct": -2.0}) == pytest.approx(0.5)
    assert engine_cost_ms({**base, "issue_ms": None}) is None
    assert engine_cost_ms({"slowdown_pct": 10.0}) is None


def test_a_much_slower_backend_does_not_qualify() -> None:
    """A backend far below the fastest wins nothing by sparing the matmul; with the share
    bound off the plain 5% rule applies."""
    options = {"kernel": (49.5, 10.0, None), "staged": (6.0, 0.1, None)}
    assert pick_backend(options, 5.0) == "kernel"
    assert pick_backend(options, 5.0, min_share_of_best=0.0) == "staged"
    assert pick_backend({"kernel": (50.0, 10.0, None), "staged": (40.0, 1.0, None)},
                        5.0) == "staged"


def test_ties_break_by_name() -> None:
    """Equal GB/s picks the alphabetically first backend, every time."""
    assert pick_backend({"staged": (50.0, 1.0, None), "kernel": (50.0, 1.0, None)}, 5.0) == "kernel"


def record(backend: str, tokens: int, gbps: float, slowdown: float | None,
           page: int = 16, issue_ms: float | None = None, op_ms: float | None = None
           ) -> dict[str, object]:
    return {"direction": "device_to_host", "layout": "layer_first", "layer_wise": False,
            "tokens": tokens, "page_size": page, "backend": backend, "gb_per_s": gbps,
            "slowdown_pct": slowdown, "issue_ms": issue_ms, "op_ms": op_ms}


def test_worst_page_size_cost_counts() -> None:
    """The engine cost a backend is judged by is its highest over the page sizes."""
    kernel = [record("kernel", 256, 30.0, 8.0, page=16, issue_ms=0.3, op_ms=0.7),
              record("kernel", 256, 30.0, 8.0, page=64, issue_ms=0.6, op_ms=0.7)]
    staged = [record("staged", 256, 25.0, 4.0, page=p, issue_ms=0.9, op_ms=0.7)
              for p in (16, 64)]
    assert choose_rows(kernel + staged)[0]["backend"] == "kernel"  # 0.656 against 0.928
    slow_page = record("kernel", 256, 30.0, 8.0, page=1, issue_ms=1.2, op_ms=0.7)
    assert choose_rows([*kernel, slow_page, *staged])[0]["backend"] == "staged"


def test_rows_per_size_with_log_midpoint_thresholds() -> None:
    """One row per size measured; the smallest covers from 0, the others from the geometric
    mean with the next smaller size."""
    rows = choose_rows([record("kernel", 256, 30.0, 12.0), record("staged", 256, 25.0, 1.0),
                        record("kernel", 2048, 45.0, 3.0), record("staged", 2048, 40.0, 1.0),
                        record("kernel", 32768, 52.0, 15.0), record("staged", 32768, 54.0, 2.0)])
    assert [(r["min_tokens"], r["measured_tokens"], r["backend"]) for r in rows] == [
        (0, 256, "staged"), (724, 2048, "kernel"), (8192, 32768, "staged")]


def test_worst_page_size_counts() -> None:
    """A backend fast at page 16 but slow, or heavy, at page 1 is judged by page 1."""
    rows = choose_rows([record("kernel", 256, 30.0, 1.0, page=16),
                        record("kernel", 256, 10.0, 1.0, page=1),
                        record("staged", 256, 20.0, 1.0, page=16),
                        record("staged", 256, 20.0, 1.0, page=1)])
    assert rows[0]["backend"] == "staged"
    rows = choose_rows([record("kernel", 256, 30.0, 1.0, page=16),
                        record("kernel", 256, 30.0, 9.0, page=1),
                        record("staged", 256, 25.0, 1.0)])
    assert rows[0]["backend"] == "staged"


def test_auto_is_no_candidate() -> None:
    """The auto backend's own figures never enter its table."""
    result = synthetic_result()
    assert {m["backend"] for m in result.auto_table["measurements"]} == {
        "torch", "kernel", "staged"}


def test_matmul_spans_inside_and_next_to_the_window() -> None:
    """Matmuls wholly inside the window are compared with the 20 on each side of it; one
    straddling an edge counts for neither, and distant ones are left out."""
    times = [float(t) for t in range(0, 101)]  # 100 matmuls of 1 s
    inside, baseline = split_spans(times, 40.5, 60.0)
    assert inside == [1.0] * 19  # 41..60; the one over 40.5 straddles the start
    assert len(baseline) == 40  # 20..40 before, 60..80 after
    times[50:] = [t + 0.5 * (t - 50) for t in times[50:]]  # slower from the 50th on
    inside, _ = split_spans(times, 40.0, 60.0)
    assert max(inside) == 1.5


def test_matmul_spans_on_the_window_edges() -> None:
    """A matmul that ends exactly where the window begins is one before it, one that starts
    exactly where it ends is one after it, and both edges' own matmuls are inside; each
    span is a duration (end - start), the baseline's nearest 20 on each side."""
    times = [float(t) * 2.0 for t in range(0, 101)]  # 100 matmuls of 2 s
    inside, baseline = split_spans(times, 80.0, 120.0)
    assert inside == [2.0] * 20  # 80..120
    assert baseline == [2.0] * 40  # 40..80 and 120..160
    times[39] = 77.0  # the two matmuls just before the window now take 1 s and 3 s
    times[61] = 123.0  # the two just after it 3 s and 1 s
    _, baseline = split_spans(times, 80.0, 120.0)
    assert baseline == [2.0] * 18 + [1.0, 3.0] + [3.0, 1.0] + [2.0] * 18


# ---- arguments ------------------------------------------------------------------------------


def test_defaults_and_quick() -> None:
    """Full sizes by default; --quick shrinks them; sizes named on the command line win."""
    args = parse_args([])
    assert (args.tokens, args.layers, args.repeats, args.auto_sizes) == (32768, 32, 5,
                                                                         [256, 2048])
    assert args.page_sizes == [1, 16] and args.backends == ["torch", "kernel", "staged", "auto"]
    args = parse_args(["--quick"])
    assert (args.tokens, args.layers, args.repeats, args.auto_sizes) == (2048, 4, 2, [256])
    assert parse_args(["--quick", "--tokens", "4096"]).tokens == 4096
    assert args.slots == "pages"
    runs = parse_args(["--slots", "runs"])
    assert runs.backends == ["torch", "kernel", "staged", "direct", "auto"]
    assert parse_args(["--slots", "runs", "--backends", "direct"]).backends == ["direct"]
    args = parse_args([])  # the shape and the run's knobs the README's tables were made with
    assert (args.heads, args.head_dim, args.torch_repeats, args.staging_tokens, args.programs,
            args.matmul_size, args.slowdown_windows, args.window_ms, args.seed) == (
        8, 128, 2, 1024, 16, 8192, 3, 20.0, 0)


def test_auto_sizes_up_to_the_op_size_are_accepted() -> None:
    """An auto size equal to --tokens is measured; one page more is refused by name."""
    assert check_args(parse_args(["--tokens", "2048", "--auto-sizes", "256", "2048"])) is None
    assert check_args(parse_args(["--tokens", "2048", "--auto-sizes", "2064"])) == (
        "--auto-sizes 2064: must not exceed --tokens (2048)")


def test_run_slots_are_one_run_each_and_move_directly() -> None:
    """--slots runs: the write sources and the load destinations are one run of pages each
    (disjoint), and a session of the direct backend moves and verifies them."""
    device_pool = make_device_pool(SMALL, "cpu")
    randomize(device_pool.data)
    slots = make_slots(device_pool, 16, SMALL.tokens, torch.Generator().manual_seed(0),
                       runs=True)
    source = slots.write_source
    assert torch.equal(source, torch.arange(int(source[0]), int(source[0]) + SMALL.tokens))
    free = slots.allocator.try_alloc(SMALL.tokens)
    assert free is not None and int(free.tensor[0]) == int(source[-1]) + 1
    slots.allocator.free(free)
    session = Session(device_pool, make_host_pool(SMALL, HostLayout.LAYER_FIRST, pin=False),
                      slots, DirectBackend())
    verifier = Verifier(device_pool, session.ctrl.host_pool)
    verifier.check_write(session, "test")
    verifier.check_load(session, "test")
    session.close()


@pytest.mark.parametrize(("argv", "message"), [
    (["--tokens", "1000"], "--tokens 1000: 1000 tokens is not a whole number of pages"),
    (["--auto-sizes", "65536"], "--auto-sizes 65536: must not exceed --tokens"),
    (["--repeats", "0"], "--repeats 0: must be >= 1"),
])
def test_bad_arguments_are_refused(argv: list[str], message: str) -> None:
    """Sizes that are not whole pages or exceed the transfer are caught before any work."""
    problem = check_args(parse_args(argv))
    assert problem is not None and message in problem


def test_cli_handler_reports_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """The subcommand's handler exits 2 with one line for a bad size."""
    assert run_cli(["--tokens", "1000"]) == 2
    assert capsys.readouterr().err.startswith("hicache bench: error: --tokens 1000: 1000 tokens")


# ---- controller driving and verification on a CPU ---------------------------------------


SMALL = Shape(tokens=64, layers=3, heads=2, head_dim=8, max_page_size=16)


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("backend", [TorchBackend(), StagedBackend(staging_tokens=24)],
                         ids=lambda b: b.name)
def test_session_moves_and_verifies_on_cpu(layout: HostLayout, page: int,
                                           backend: TransferBackend) -> None:
    """Writes, loads and back-to-back batches through the controller pass the bit-exact
    checks and give every slot back."""
    device_pool = make_device_pool(SMALL, "cpu")
    randomize(device_pool.data)
    host_pool = make_host_pool(SMALL, layout, pin=False)
    slots = make_slots(device_pool, page, SMALL.tokens, torch.Generator().manual_seed(0))
    session = Session(device_pool, host_pool, slots, backend)
    verifier = Verifier(device_pool, host_pool)
    verifier.check_write(session, "test")
    verifier.check_load(session, "test")
    for batch in (session.write_ops(4, 16), session.load_ops(4, 16)):
        assert len({item.op.op_id for item in batch}) == 4
        session.finish(batch)
    session.close()
    assert host_pool.allocator.num_used_tokens == 0
    assert slots.allocator.num_free_tokens == SMALL.tokens


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("backend", [TorchBackend(), StagedBackend(staging_tokens=24),
                                     StagedBackend(staging_tokens=128)],
                         ids=lambda b: f"{b.name}-{getattr(b, 'staging_tokens', '')}")
def test_page_first_direct_case_uses_host_pages_of_its_page_size(
        page: int, backend: TransferBackend) -> None:
    """A page_first_direct case gets a host pool of its own page size (that arranges its
    bytes), and its writes and loads pass the bit-exact checks."""
    shape = Shape(tokens=128, layers=3, heads=2, head_dim=8, max_page_size=64)
    plans = host_page_sizes(HostLayout.PAGE_FIRST_DIRECT, [16, 64])
    assert plans == [(16, [16]), (64, [64])]
    assert host_page_sizes(HostLayout.PAGE_FIRST, [16, 64]) == [(64, [16, 64])]
    device_pool = make_device_pool(shape, "cpu")
    randomize(device_pool.data)
    host_pool = make_host_pool(shape, HostLayout.PAGE_FIRST_DIRECT, pin=False, page_size=page)
    assert host_pool.page_size == page and host_pool.data.shape[3] == page
    assert host_pool.allocator.capacity_tokens == shape.pool_pages * 64
    slots = make_slots(device_pool, page, shape.tokens, torch.Generator().manual_seed(0))
    session = Session(device_pool, host_pool, slots, backend)
    verifier = Verifier(device_pool, host_pool)
    verifier.check_write(session, "test")
    verifier.check_load(session, "test")
    session.close()
    assert host_pool.allocator.num_used_tokens == 0


def test_report_widens_the_layout_column_for_page_first_direct() -> None:
    """With page_first_direct rows every table keeps its columns aligned."""
    result = synthetic_result()
    extra = [replace(m, layout="page_first_direct") for m in result.measurements]
    result = BenchResult(result.meta, result.ceiling, result.matmul_alone_s,
                         result.staging_bytes, result.measurements + extra,
                         auto_table(result.measurements + extra, {"device": "Test GPU"}))
    lines = render(result).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backend page"))
    body = lines[start + 2: start + 2 + 24]
    assert len({len(line) for line in body}) == 1
    assert sum("page_first_direct" in line for line in body) == 8
    auto_rows = [line for line in lines if line.startswith(("device_to_host",
                                                            "host_to_device"))]
    assert len({line.index("True") if "True" in line else line.index("False")
                for line in auto_rows}) == 1


def test_device_slots_are_random_disjoint_pages() -> None:
    """Write sources and load destinations are whole pages, random and disjoint."""
    device_pool = make_device_pool(SMALL, "cpu")
    slots = make_slots(device_pool, 16, SMALL.tokens, torch.Generator().manual_seed(0))
    source = slots.write_source.view(-1, 16)
    assert bool((source == source[:, :1] + torch.arange(16)).all())
    assert bool((source[:, 0] % 16 == 0).all()) and not bool((source == 0).any())
    loaded = slots.allocator.try_alloc(SMALL.tokens)
    assert loaded is not None
    assert not set(loaded.tensor.tolist()) & set(slots.write_source.tolist())


class DropsOneRow(TorchBackend):
    """Moves everything, then overwrites one moved host row (a corrupting backend)."""

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        super().copy(moved, local_layers, direction, keep_alive)
        moved.source.host_pool.layer_rows(1, local_layers[-1])[moved.host_index[5]] = 0.0


def test_verification_aborts_on_a_wrong_row() -> None:
    """A backend that corrupts one row is caught, naming component, layer and slots."""
    device_pool = make_device_pool(SMALL, "cpu")
    randomize(device_pool.data)
    host_pool = make_host_pool(SMALL, HostLayout.PAGE_FIRST, pin=False)
    slots = make_slots(device_pool, 1, SMALL.tokens, torch.Generator().manual_seed(0))
    session = Session(device_pool, host_pool, slots, DropsOneRow())
    with pytest.raises(BenchmarkError, match="MISMATCH in test write: component 1, layer 2"):
        Verifier(device_pool, host_pool).check_write(session, "test")


# ---- the GPU run ----------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_run_without_cuda_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """Without CUDA the run stops at once with one line naming the reason (exit 1)."""
    assert main(["--quick"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(under_sanitizer(), reason="a benchmark: its kernels run under the "
                    "sanitizer in the kernel, staged and controller tests, and under racecheck "
                    "a tiny configuration had not finished after 220 s")
def test_quick_run_on_gpu(tmp_path: Path) -> None:
    """The smoke run completes, verifies every configuration and writes its JSON; each
    figure is its op's bytes (both directions: twice a transfer's) over its median time, and
    its percentage is of its own direction's ceiling."""
    path = tmp_path / "bench.json"
    assert main(["--quick", "--json", str(path)]) == 0
    result = load_json(path)
    assert result.auto_table["rows"]
    token_bytes = result.meta["token_bytes"]
    assert result.measurements
    for m in result.measurements:
        assert m.bytes == m.tokens * token_bytes * (2 if m.kind == "both" else 1), m
        assert m.gb_per_s == pytest.approx(m.bytes / m.seconds / 1e9), m
        assert m.pct_of_ceiling == pytest.approx(
            100 * m.gb_per_s / result.ceiling.one_way(m.kind)), m


def test_auto_ranks_layer_wise_loads_over_issue_plus_gpu_time() -> None:
    """A load backend a little faster on the GPU but slow to issue loses to one that issues
    quickly (the forward waits for both); writes are ranked by GPU time alone."""
    def timed(backend: str, kind: str, gbps: float, issue_ms: float) -> Measurement:
        m = measurement(backend, kind, 16, "layer_first", gbps, tokens=8192)
        m.issue_s = issue_ms / 1e3
        return m

    # 8192 tokens x 128 KiB = 1 GiB: 21.9 ms at 49 GB/s, 20.8 ms at 51.5 GB/s
    loads = [timed("kernel", "load", 49.0, 3.0), timed("staged", "load", 51.5, 12.0)]
    writes = [timed("kernel", "write", 51.5, 3.0), timed("staged", "write", 49.0, 12.0)]
    table = auto_table(loads + writes, {"device": "Test GPU"}, max_slowdown_pct=5.0)
    chosen = {r["direction"]: r["backend"] for r in table["rows"]}
    assert chosen == {"host_to_device": "kernel", "device_to_host": "kernel"}
    writes_only = auto_table([timed("kernel", "write", 49.0, 3.0),
                              timed("staged", "write", 51.5, 12.0)], {"device": "Test GPU"})
    assert [r["backend"] for r in writes_only["rows"]] == ["staged"]
    assert "issue plus GPU time" in table["rule"]


def test_checks_bench_times_every_row_on_a_cpu(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m hicache.bench.checks`` on a CPU: every row, the forward's set_kv rows
    among them, gets a positive CPU time, in the table and in the JSON."""
    from hicache.bench import checks

    out = tmp_path / "checks.json"
    assert checks.main(["--device", "cpu", "--repeats", "3", "--tokens", "256", "--batch",
                        "4", "--max-pages", "8", "--new-tokens", "16", "--json",
                        str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {row["call"]: row["cpu_us"] for row in json.loads(out.read_text())["rows"]}
    for call in ("set_kv of 16 tokens, ForwardLocs, slots given on the device",
                 "set_kv of 16 tokens, ForwardLocs, slots given on the CPU",
                 "forward_locs of 16 CPU slots, a run (check)",
                 "  and its .full read (the run made on the device)",
                 "forward_locs of 16 CPU slots, not a run (check + upload)",
                 "key_buffer + value_buffer of a layer"):
        assert call in rows and call in printed
    assert all(cpu_us > 0 for cpu_us in rows.values())


# ---- option values and --from-json inputs, checked before any work ---------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["--window-ms", "0"], "--window-ms 0: must be a finite number > 0"),
    (["--window-ms", "inf"], "--window-ms inf: must be a finite number > 0"),
    (["--max-slowdown-pct", "-1"], "--max-slowdown-pct -1: must be a finite number >= 0"),
    (["--min-share-of-best", "1.5"], "--min-share-of-best 1.5: must be a finite number >= 0 "
                                     "and <= 1"),
    (["--page-sizes", "16", "-4"], "--page-sizes -4: must be >= 1"),
    (["--auto-sizes", "0"], "--auto-sizes 0: must be >= 1"),
])
def test_bad_option_values_name_the_option_and_value(argv: list[str], message: str) -> None:
    problem = check_args(parse_args(argv))
    assert problem is not None and problem.startswith(message), problem


def test_edge_values_are_accepted() -> None:
    """0 disables the share rule; 0 % slowdown is a (strict) bound."""
    assert check_args(parse_args(["--min-share-of-best", "0", "--max-slowdown-pct", "0"])) is None


@pytest.mark.parametrize("option", ["--plot", "--auto-table"])
def test_outputs_never_overwrite_a_from_json_input(option: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """An output naming one of the inputs (here the second, through another spelling of its
    path): exit 2 naming the option, the input kept."""
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path in paths:
        save_json(synthetic_result(), path)
    before = paths[1].read_bytes()
    other_spelling = tmp_path / "sub" / ".." / "b.json"
    (tmp_path / "sub").mkdir()
    assert main(["--from-json", *map(str, paths), option, str(other_spelling)]) == 2
    err = capsys.readouterr().err
    assert f"{option} {other_spelling}: is the --from-json file" in err, err
    assert paths[1].read_bytes() == before


def test_from_json_of_a_directory_names_it(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--from-json", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hicache bench: error: --from-json {tmp_path}: cannot read it")
    assert err.count("\n") == 1


def test_several_saved_runs_report_the_first_with_the_table_of_all(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--from-json with several runs prints the first run's report (its header, taken on
    its day) and derives the auto table from all of them."""
    runs = [noisy_run(15.0), noisy_run(26.0)]
    runs[1] = replace(runs[1], meta={**runs[1].meta, "date": "2026-02-02"})
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        save_json(run, paths[-1])
    assert main(["--from-json", *map(str, paths)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header == f"Test GPU, torch 2.x, {runs[0].meta['date']}"
